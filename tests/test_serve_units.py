"""Pure pieces of the server: text streaming with stop strings, metric arithmetic, request checks."""

from __future__ import annotations

import shutil

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cli_generate import make_tokenizer

from draftsman.serve.app import validation_error
from draftsman.serve.metrics import ServeMetrics
from draftsman.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_request,
    unsupported_parameter,
)
from draftsman.serve.scheduler import histogram_delta
from draftsman.serve.text import TextStream, cut_at_stop, final_text
from draftsman.spec.verify import summarize_histogram


@pytest.fixture(scope="module")
def tok(tiny_llama_dir, tmp_path_factory):
    return make_tokenizer(shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("tok") / "t"))


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("a b c d", ["c", "b"]) == ("a ", True)
    assert cut_at_stop("a b", ["x"]) == ("a b", False)


@pytest.mark.parametrize("stops", [(), ("w9",), ("w7 w8", "nothing")])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_text_stream_concatenates_to_the_final_text(tok, stops, split):
    ids = [*tok.encode("hello w5 w6 w7 w8 w9 world", add_special_tokens=False), 2]  # ends with EOS
    stream = TextStream(tok, stops)
    out = "".join(stream.push(ids[i:i + split]) for i in range(0, len(ids), split)) + stream.finish()
    assert out == final_text(tok, ids, stops)
    assert not any(s in out for s in stops)


def test_text_stream_never_sends_a_stop_strings_beginning(tok):
    stream = TextStream(tok, ["w7 w8"])
    sent = [stream.push(tok.encode(w, add_special_tokens=False)) for w in ["hello", "w7"]]
    assert "w7" not in "".join(sent)  # held back: it may still become the stop string
    rest = stream.push(tok.encode("w8", add_special_tokens=False)) + stream.finish()
    assert "".join(sent) + rest == "hello "  # the text before the stop string, nothing of it


def test_text_stream_without_tokenizer_is_silent():
    stream = TextStream(None)
    assert stream.push([1, 2]) == "" and stream.finish() == ""


def metric_values(m: ServeMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}


def test_speculation_counters_give_tau_and_per_position_rates():
    m = ServeMetrics("x")
    m.init_positions(3)
    hist = [2, 1, 0, 3]  # rounds that accepted 0, 1, 2, 3 drafts
    m.count_rounds(hist, draft_tokens=sum(hist) * 5)
    v = metric_values(m)
    ref = summarize_histogram(hist, 5)
    drafts = v[("draftsman:spec_decode_num_drafts_total", (("model_name", "x"),))]
    accepted = v[("draftsman:spec_decode_num_accepted_tokens_total", (("model_name", "x"),))]
    assert drafts == ref["rounds"] == 6
    assert v[("draftsman:spec_decode_num_draft_tokens_total", (("model_name", "x"),))] == ref["drafted_tokens"]
    assert 1 + accepted / drafts == pytest.approx(ref["accept_length"])
    per_pos = [v[("draftsman:spec_decode_num_accepted_tokens_per_pos_total",
                  (("model_name", "x"), ("position", str(i))))] / drafts for i in range(3)]
    assert per_pos == pytest.approx(ref["accept_rate_per_position"])


def test_histogram_delta_handles_growth():
    assert histogram_delta([3, 1, 2], [1, 1]) == [2, 0, 2]


def test_unsupported_parameters_are_named():
    assert unsupported_parameter(CompletionRequest(prompt="x")) is None
    assert unsupported_parameter(CompletionRequest(prompt="x", n=3)) == "n"
    assert unsupported_parameter(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                       tool_choice="auto")) is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert unsupported_parameter(chat) == "top_logprobs"
    with pytest.raises(APIError) as e:
        check_request(CompletionRequest(prompt="x", stop=["ok", ""]))
    assert e.value.param == "stop" and e.value.status == 400


def test_validation_error_names_the_field():
    err = validation_error([{"loc": ("body", "max_tokens"), "msg": "Input should be a valid integer",
                             "type": "int_type"}])
    assert err.status == 400 and err.param == "max_tokens" and "max_tokens" in err.message
    body = validation_error([{"loc": ("body", 5), "msg": "JSON decode error", "type": "json_invalid",
                              "ctx": {"error": "Expecting value"}}]).body()
    assert body["error"]["code"] == "invalid_json" and "Expecting value" in body["error"]["message"]
