"""`draftsman prepare-data`: the target writes the answers, locally or through an OpenAI-compatible
server; output equals `generate --chat`, and interrupted runs resume without losses or duplicates."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftsman.cli import main
from draftsman.commands import prepare_data
from draftsman.commands.prepare_data import Job, read_done_ids, unique_ids
from draftsman.train.data import tokenize_file

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
EOS = 2

RECORDS = [
    {"id": "p1", "prompt": "hello world"},
    {"id": "mt", "conversations": [
        {"from": "system", "value": "be nice"}, {"from": "human", "value": "how are you"},
        {"from": "gpt", "value": "not the target's words"}, {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "nor these"}]},
    {"question": "how are you", "answer": "w5 w6"},
    {"id": "p1", "prompt": "you"},  # a repeated id
]
IDS = ["p1", "mt", "3", "p1#2"]


def make_chat_tokenizer():
    """Word-level over the tiny target's 256 ids, so decoded answers re-encode to the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>", "system", "user", "assistant", ":", "hello", "world", "how",
             "are", "you", "be", "nice"]
    words += [f"w{i}" for i in range(256 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The target is tiny: intra-op threads only add synchronisation (100x slower on a busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def chat_target(tiny_llama_dir, tmp_path_factory):
    d = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("chat") / "m")
    make_chat_tokenizer().save_pretrained(d)
    return d


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def prepare(target, inp, out, *extra: str) -> int:
    return main(["prepare-data", "--target", str(target), "--input", str(inp), "--output", str(out),
                 "--max-new-tokens", "6", *extra])


def read_out(path) -> dict[str, list[dict]]:
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), f"duplicated records: {ids}"
    return {r["id"]: r["messages"] for r in records}


def generate_ids(capsys, target, *args: str) -> list[int]:
    capsys.readouterr()
    assert main(["generate", "--target", str(target), "--max-new-tokens", "6", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]


def answer_ids(tok, text: str, generated: list[int]) -> list[int]:
    """The ids an answer text stands for, with the EOS that ended it when generation stopped there."""
    ids = tok.encode(text, add_special_tokens=False)
    return [*ids, EOS] if generated and generated[-1] == EOS else ids


# ---- pure pieces ------------------------------------------------------------------------------------
def test_job_turns_interleave_answers():
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "user", "content": "u2"}, {"role": "system", "content": "S2"}]
    job = Job("x", base)
    assert job.num_turns == 2 and job.context() == base[:2]
    job.answers.append("a1")
    assert job.context() == [*base[:2], {"role": "assistant", "content": "a1"}, base[2]]
    assert job.conversation() == [*base[:2], {"role": "assistant", "content": "a1"}]
    job.answers.append("a2")
    assert job.done
    assert job.conversation() == [*base[:2], {"role": "assistant", "content": "a1"}, base[2],
                                  {"role": "assistant", "content": "a2"}]


def test_unique_ids_are_deterministic():
    got = [i for i, _ in unique_ids([("a", []), ("a", []), ("a#2", []), ("b", []), ("a", [])])]
    assert got == ["a", "a#2", "a#2#2", "b", "a#3"]


def test_read_done_ids_drops_a_torn_tail(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text('{"id": "a", "messages": []}\n{"id": 7, "messages": []}\n{"id": "c", "mess')
    ids, torn = read_done_ids(path)
    assert ids == {"a", "7"} and torn == len('{"id": "c", "mess')
    assert path.read_text().endswith('"messages": []}\n')
    path.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(SystemExit, match=r"o.jsonl:2 is not a prepare-data record"):
        read_done_ids(path)


# ---- local decoding ---------------------------------------------------------------------------------
def test_answers_equal_generate_chat_and_condition_on_own_answers(chat_target, corpus, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert prepare(chat_target, corpus, out, "--batch-size", "2") == 0
    assert "wrote 4 records" in capsys.readouterr().out
    got = read_out(out)
    assert sorted(got) == sorted(IDS)
    tok = make_chat_tokenizer()

    # single turn: the answer is `draftsman generate --chat`'s greedy output, token for token
    p1 = got["p1"]
    assert [m["role"] for m in p1] == ["user", "assistant"] and p1[0]["content"] == "hello world"
    expected = generate_ids(capsys, chat_target, "--prompt", "hello world", "--chat")
    assert answer_ids(tok, p1[1]["content"], expected) == expected

    # multi-turn: the source's answers are replaced, turn 2 sees the target's own turn-1 answer
    mt = got["mt"]
    assert [m["role"] for m in mt] == ["system", "user", "assistant", "user", "assistant"]
    assert "not the target" not in mt[2]["content"] and "nor these" not in mt[4]["content"]
    for k in (2, 4):
        prompt = tok.apply_chat_template(mt[:k], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        expected = generate_ids(capsys, chat_target, "--prompt-ids", ",".join(map(str, ids)))
        assert answer_ids(tok, mt[k]["content"], expected) == expected

    # the output is training data: its loss-masked ids are what the target generated (+ end of turn)
    examples = tokenize_file(tok, out)
    assert len(examples) == 4
    first = examples[[r["id"] for r in map(json.loads, out.read_text().splitlines())].index("p1")]
    masked = [t for t, m in zip(first.input_ids, first.loss_mask, strict=True) if m]
    gen = generate_ids(capsys, chat_target, "--prompt", "hello world", "--chat")
    assert masked == (gen if gen[-1] == EOS else [*gen, EOS])


def test_resume_after_partial_run_torn_line_and_interrupt(chat_target, corpus, tmp_path, capsys, monkeypatch):
    full = tmp_path / "full.jsonl"
    assert prepare(chat_target, corpus, full) == 0
    reference = sorted(full.read_text().splitlines())

    # a first run over part of the input, then the whole: nothing redone, nothing lost
    out = tmp_path / "out.jsonl"
    assert prepare(chat_target, corpus, out, "--num-samples", "2") == 0
    head = out.read_text()
    assert len(head.splitlines()) == 2
    assert prepare(chat_target, corpus, out) == 0
    assert out.read_text().startswith(head)
    assert sorted(out.read_text().splitlines()) == reference
    assert "2 were already there" in capsys.readouterr().out
    assert prepare(chat_target, corpus, out) == 0  # a finished run is a no-op
    assert sorted(out.read_text().splitlines()) == reference

    # a torn last line (killed mid-write) is dropped and its record redone
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    assert prepare(chat_target, corpus, out) == 0
    assert "dropped a torn last line" in capsys.readouterr().err
    assert sorted(out.read_text().splitlines()) == reference

    # an interrupt mid-run keeps every finished record; the rerun completes the rest
    calls = []
    real = prepare_data.LocalBackend.generate

    def interrupted(self, prompts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, prompts)

    out2 = tmp_path / "out2.jsonl"
    monkeypatch.setattr(prepare_data.LocalBackend, "generate", interrupted)
    assert prepare(chat_target, corpus, out2, "--batch-size", "1") == 130
    assert len(out2.read_text().splitlines()) == 1  # the first record, written before the interrupt
    monkeypatch.setattr(prepare_data.LocalBackend, "generate", real)
    assert prepare(chat_target, corpus, out2, "--batch-size", "3") == 0
    assert sorted(out2.read_text().splitlines()) == reference


def test_drafter_speeds_up_without_changing_the_output(chat_target, tmp_path):
    from draftsman.models import load_target
    from draftsman.models.eagle3 import init_drafter, save_drafter

    # a 40-position window: some rows fit a speculative batch, some sit too close to the window
    small = shutil.copytree(chat_target, tmp_path / "small")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 40}))
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [
        *RECORDS, {"id": "near", "prompt": " ".join(["w9"] * 30)}]))
    drafter = save_drafter(init_drafter(load_target(small), seed=0), tmp_path / "drafter")
    plain, spec = tmp_path / "plain.jsonl", tmp_path / "spec.jsonl"
    assert prepare(small, inp, plain, "--max-new-tokens", "12") == 0
    assert prepare(small, inp, spec, "--max-new-tokens", "12", "--drafter", str(drafter), "--spec-steps", "3",
                   "--spec-topk", "2", "--spec-draft-tokens", "6") == 0
    assert read_out(spec) == read_out(plain)
    assert len(read_out(plain)["near"][1]["content"].split()) <= 40 - 35


def test_prompts_past_max_positions_are_skipped(chat_target, tmp_path, capsys):
    small = shutil.copytree(chat_target, tmp_path / "small")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    tok = make_chat_tokenizer()
    tok.chat_template = "{% if messages[-1]['content'] == 'w7' %}{{ raise_exception('no w7') }}{% endif %}" + TEMPLATE
    tok.save_pretrained(small)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "short", "prompt": "hello"},  # 6 prompt tokens
        {"id": "long", "prompt": " ".join(["w9"] * 20)},
        {"id": "two", "turns": ["hello", " ".join(["w9"] * 10)]},  # turn 2 does not fit
        {"id": "empty", "conversations": []},
        {"id": "rejected", "prompt": "w7"},
    ]))
    out = tmp_path / "out.jsonl"
    assert prepare(small, inp, out, "--max-new-tokens", "40") == 0
    summary = capsys.readouterr().out
    assert "skipped 1 records whose prompt exceeds the target's 16 positions" in summary
    assert "cut 1 multi-turn records short" in summary and "1 records without a user turn" in summary
    assert "skipped 1 records and cut 0 short that the chat template rejects (first: record rejected: no w7" in summary
    got = read_out(out)
    assert sorted(got) == ["short", "two"]
    assert [m["role"] for m in got["two"]] == ["user", "assistant"]
    # answers stop at the target's window: prompt (6) + answer <= 16
    assert len(tok.encode(got["short"][1]["content"], add_special_tokens=False)) <= 10


def test_bad_arguments_are_explained(chat_target, corpus, tmp_path):
    with pytest.raises(SystemExit, match="--target DIR"):
        main(["prepare-data", "--input", str(corpus), "--output", str(tmp_path / "o.jsonl")])
    with pytest.raises(SystemExit, match="no such file"):
        prepare(chat_target, tmp_path / "missing.jsonl", tmp_path / "o.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n{"oops": 1}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: unrecognised record"):
        prepare(chat_target, bad, tmp_path / "o.jsonl")


# ---- server mode ------------------------------------------------------------------------------------
class FakeOpenAI(BaseHTTPRequestHandler):
    """Deterministic answers; the first chat request fails with a 500; prompt 'bad' gets a 400."""

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        with state["lock"]:
            state["posts"].append(body)
            first = len(state["posts"]) == 1
        if first:
            return self._send(500, {"error": "warming up"})
        if self.path != "/v1/chat/completions" or body.get("model") != "fake-model":
            return self._send(400, {"error": f"bad request {self.path} {body.get('model')}"})
        last = body["messages"][-1]["content"]
        if last == "bad":
            return self._send(400, {"error": {"message": "prompt rejected"}})
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        self._send(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": f"answer {turn} to {last}"}}],
                         "usage": {"completion_tokens": 4}})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.state = {"posts": [], "lock": threading.Lock()}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_server_mode_retries_and_resumes(fake_server, corpus, tmp_path, capsys):
    server, url = fake_server
    out = tmp_path / "out.jsonl"
    args = ["prepare-data", "--server-url", url + "/v1", "--input", str(corpus), "--output", str(out),
            "--concurrency", "3", "--max-new-tokens", "7"]
    assert main(args) == 0
    got = read_out(out)
    assert got["p1"] == [{"role": "user", "content": "hello world"},
                         {"role": "assistant", "content": "answer 0 to hello world"}]
    assert got["mt"] == [{"role": "system", "content": "be nice"},
                         {"role": "user", "content": "how are you"},
                         {"role": "assistant", "content": "answer 0 to how are you"},
                         {"role": "user", "content": "hello"},
                         {"role": "assistant", "content": "answer 1 to hello"}]
    assert got["p1#2"][1]["content"] == "answer 0 to you" and sorted(got) == sorted(IDS)
    posts = server.state["posts"]
    assert len(posts) == 5 + 1  # five turns, one retried after the 500
    assert all(p["max_tokens"] == 7 and p["temperature"] == 0.0 for p in posts)
    turn2 = next(p for p in posts if p["messages"][-1]["content"] == "hello" and len(p["messages"]) > 2)
    assert turn2["messages"][2] == {"role": "assistant", "content": "answer 0 to how are you"}
    # rerun: everything is there, no request is sent
    assert main(args) == 0
    assert len(server.state["posts"]) == 6 and "4 were already there" in capsys.readouterr().out


def test_server_client_error_stops_the_run(fake_server, tmp_path):
    server, url = fake_server
    server.state["posts"].append({})  # no transient 500 this time
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "bad"}) + "\n")
    with pytest.raises(SystemExit, match=r"HTTP 400: .*prompt rejected"):
        main(["prepare-data", "--server-url", url, "--model", "fake-model", "--input", str(inp),
              "--output", str(tmp_path / "o.jsonl")])
