"""Training data: record readers, template-derived loss masks, the draft vocabulary and its cache."""

from __future__ import annotations

import gzip
import json
import logging
import re

import pytest
import torch

from draftsman.train.data import (
    LossMaskError,
    TokenizedConversation,
    read_records,
    tokenize_conversation,
    tokenize_file,
)
from draftsman.train.vocab import (
    build_vocab_mapping,
    cached_vocab_mapping,
    fingerprint_files,
)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
DROPS_ASSISTANT = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                   "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
WORDS = ["system", "user", "assistant", "be", "nice", "hello", "hi", "there", "how", "are", "you", "fine",
         "ok", "bye", "one", "two", "three", "four", "five"]

CONVO = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi there"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine ok bye"},
]


def chatml_tokenizer(template: str = CHATML):
    """Word-level: every word and special token is one token, so masks can be read as words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def llama3_tokenizer():
    """Byte-level BPE with Llama-3's special tokens, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3
    return fast


def masked_runs(tokenizer, ex: TokenizedConversation) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for tid, m in zip([*ex.input_ids, -1], [*ex.loss_mask, 0], strict=True):
        if m:
            cur.append(tid)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs


def write_jsonl(path, records, gz: bool = False):
    text = "".join(json.dumps(r) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


# ---- readers ---------------------------------------------------------------------------------------
def test_read_records_every_format(tmp_path):
    records = [
        {"id": "sg1", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}, {"from": "user", "value": "q2"},
                                        {"from": "assistant", "value": "a2"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"task_id": "HumanEval/0", "prompt": "def f():"},
        {"instruction": "Do X", "input": "with Y", "response": "done"},
        {"instruction": "Do Z", "input": "", "response": "ok"},
        {"question": "1+1?", "answer": "2\n#### 2"},
        {"question_id": 81, "turns": ["first", "second"]},
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl.gz", records[:1], gz=True)
    assert list(read_records(path)) == [("sg1", [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"}])]
    plain = tmp_path / "mixed.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in records[1:3]) + "\n\n"
                     + "\n".join(json.dumps(r) for r in records[3:]) + "\n")
    got = list(read_records(plain))
    assert [rid for rid, _ in got] == ["1", "HumanEval/0", "4", "5", "6", "81"]  # the blank line 3 counts
    assert got[0][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert got[1][1] == [{"role": "user", "content": "def f():"}]
    assert got[2][1] == [{"role": "user", "content": "Do X\n\nwith Y"}, {"role": "assistant", "content": "done"}]
    assert got[3][1] == [{"role": "user", "content": "Do Z"}, {"role": "assistant", "content": "ok"}]
    assert got[4][1] == [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2\n#### 2"}]
    assert got[5][1] == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]


@pytest.mark.parametrize("line,message", [
    ('{"conversations": [{"from": "human", "value": "q"}', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "no schema"}', "unrecognised record"),
    ('{"conversations": [{"from": "robot", "value": "q"}]}', "unknown speaker"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "unsupported role"),
    ('{"prompt": 3}', "prompt must be a string"),
])
def test_read_records_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        list(read_records(path))


def test_read_records_truncated_gzip_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl.gz", [{"prompt": f"p{i}" * 50} for i in range(200)], gz=True)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match="corrupt or truncated gzip"):
        list(read_records(path))


def test_read_shared_sharegpt_corpus_head():
    from conftest import SHARED

    path = SHARED / "data/train/sharegpt_v3_partial.jsonl.gz"
    if not path.exists():
        pytest.skip("shared data not present")
    from itertools import islice

    head = list(islice(read_records(path), 50))
    assert len(head) == 50 and all(m["role"] in ("system", "user", "assistant") for _, ms in head for m in ms)


# ---- loss masks ------------------------------------------------------------------------------------
def test_chatml_mask_marks_exactly_the_assistant_turns():
    tok = chatml_tokenizer()
    ex = tokenize_conversation(tok, CONVO)
    marked = [w for w, m in zip(tok.convert_ids_to_tokens(ex.input_ids), ex.loss_mask, strict=True) if m]
    assert marked == ["hi", "there", "<|im_end|>", "fine", "ok", "bye", "<|im_end|>"]
    assert len(ex.input_ids) == len(ex.loss_mask)
    # the ids are the template's own tokenization (as apply_chat_template(tokenize=True) gives)
    rendered = tok.apply_chat_template(CONVO, tokenize=False)
    assert ex.input_ids == tok.encode(rendered, add_special_tokens=False)


def test_llama3_bpe_mask_marks_content_and_end_of_turn(llama3_tokenizer):
    tok = llama3_tokenizer
    ex = tokenize_conversation(tok, CONVO)
    assert masked_runs(tok, ex) == ["hi there<|eot_id|>", "fine ok bye<|eot_id|>"]
    assert ex.input_ids[0] == tok.bos_token_id and ex.loss_mask[0] == 0
    # everything unmasked is prompt: system and user content, headers
    unmasked = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if not m])
    assert "be nice" in unmasked and "how are you" in unmasked and "hi" not in unmasked.replace("<|", "")


def test_single_turn_without_system(llama3_tokenizer):
    ex = tokenize_conversation(llama3_tokenizer, CONVO[1:3])
    assert masked_runs(llama3_tokenizer, ex) == ["hi there<|eot_id|>"]


def test_truncation_cuts_ids_and_mask():
    tok = chatml_tokenizer()
    full = tokenize_conversation(tok, CONVO)
    cut = tokenize_conversation(tok, CONVO, max_length=14)
    assert cut.input_ids == full.input_ids[:14] and cut.loss_mask == full.loss_mask[:14]
    # cut inside the prompt: nothing left to learn, returned with an empty mask (callers skip it)
    early = tokenize_conversation(tok, CONVO, max_length=5)
    assert len(early.input_ids) == 5 and not any(early.loss_mask)
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tok, CONVO, max_length=0)


@pytest.mark.parametrize("template,message", [
    # the generation prompt says "bot" but assistant turns render as "assistant"
    (CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>bot\n{% endif %}"),
     "add_generation_prompt=True is not a prefix"),
    # assistant content dropped, header and end marker kept
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
     "{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "drops or rewrites assistant"),
    # assistant turns dropped entirely, and no generation prompt
    (DROPS_ASSISTANT, "drops or rewrites assistant"),
    # with a generation prompt the last user message is not rendered: the span swallows it
    ("{% for m in messages %}{% if not (add_generation_prompt and loop.last) %}<|im_start|>{{ m['role'] }}\n"
     "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}", "covers the prompt"),
    # the last turn is rendered differently from the same turn inside a longer conversation
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last %}bye {% endif %}"
     "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
     "{% endif %}", "not a prefix of the whole conversation"),
    # a template that raises on the conversation
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_bad_templates_fail_loudly(template, message):
    with pytest.raises(LossMaskError, match=re.escape(message)):
        tokenize_conversation(chatml_tokenizer(template), CONVO)


def test_conversation_without_answer_has_empty_mask():
    with pytest.raises(LossMaskError, match="no assistant message"):
        tokenize_conversation(chatml_tokenizer(), CONVO[:2])
    # an empty answer under a template that drops assistant turns leaves nothing to mark
    with pytest.raises(LossMaskError, match="empty loss mask: no token"):
        tokenize_conversation(chatml_tokenizer(DROPS_ASSISTANT), [*CONVO[:2], {"role": "assistant", "content": ""}])


def test_tokenize_file_skips_truncated_and_unanswered(tmp_path, caplog):
    tok = chatml_tokenizer()
    long_prompt = " ".join(["one"] * 40)
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": CONVO},
        {"prompt": "hello"},  # no answer yet
        {"question": long_prompt, "answer": "two"},  # answer lies past max_length
        {"question": "hello", "answer": "three four"},
    ])
    with caplog.at_level(logging.WARNING):
        out = tokenize_file(tok, path, max_length=30)
    assert len(out) == 2
    assert "1 records without an assistant turn and 1 whose assistant tokens" in caplog.text
    assert len(tokenize_file(tok, path, max_length=30, num_samples=1)) == 1
    with pytest.raises(ValueError, match="no usable record"):
        tokenize_file(tok, write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}]))


def test_tokenize_file_names_the_record_on_template_errors(tmp_path):
    tok = chatml_tokenizer(CHATML.replace("assistant\n{% endif %}", "bot\n{% endif %}"))
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "r7", "messages": CONVO}])
    with pytest.raises(LossMaskError, match=f"{re.escape(str(path))}: record r7: "):
        tokenize_file(tok, path)


# ---- vocabulary mapping ----------------------------------------------------------------------------
def ex(ids, mask=None):
    return TokenizedConversation(list(ids), list(mask) if mask is not None else [1] * len(ids))


def test_vocab_mapping_most_frequent_masked_tokens():
    examples = [ex([5, 5, 5, 9, 9, 1, 7], [1, 1, 1, 1, 1, 1, 0]), ex([7, 7, 7, 7], [0, 0, 0, 0]), ex([1, 3])]
    m = build_vocab_mapping(examples, vocab_size=12, draft_vocab_size=3)
    # counts under the mask: 5:3, 9:2, 1:2, 3:1; 7 only occurs unmasked
    assert m.counts.tolist() == [0, 2, 0, 1, 0, 3, 0, 0, 0, 2, 0, 0]
    assert m.draft_token_ids.tolist() == [1, 5, 9]
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    draft = torch.arange(3)
    assert (draft + m.d2t[draft]).tolist() == m.draft_token_ids.tolist()  # offsets round-trip
    assert m.t2d.nonzero().flatten().tolist() == [1, 5, 9]


def test_vocab_mapping_ties_break_by_lowest_id_and_fills_unseen():
    m = build_vocab_mapping([ex([8, 4, 6, 8])], vocab_size=10, draft_vocab_size=3)
    assert m.draft_token_ids.tolist() == [4, 6, 8]  # 8 first, then the tie 4/6 both fit
    m = build_vocab_mapping([ex([8, 4, 6, 8])], vocab_size=10, draft_vocab_size=2)
    assert m.draft_token_ids.tolist() == [4, 8]  # tie between 4 and 6: the lower id wins
    # fewer distinct tokens than N: the rest is filled with the lowest unseen ids
    m = build_vocab_mapping([ex([8, 4])], vocab_size=10, draft_vocab_size=5)
    assert m.draft_token_ids.tolist() == [0, 1, 2, 4, 8]
    assert m.d2t.numel() == 5 and int(m.t2d.sum()) == 5
    # N larger than the target vocabulary: N = V, the identity mapping
    m = build_vocab_mapping([ex([3])], vocab_size=6, draft_vocab_size=32000)
    assert m.draft_token_ids.tolist() == list(range(6)) and not m.d2t.any() and bool(m.t2d.all())


def test_vocab_mapping_is_what_the_drafter_checks():
    from draftsman.models.eagle3 import check_vocab_mapping

    g = torch.Generator().manual_seed(0)
    examples = [ex(torch.randint(0, 500, (200,), generator=g).tolist()) for _ in range(5)]
    m = build_vocab_mapping(examples, vocab_size=500, draft_vocab_size=64)
    check_vocab_mapping(m.d2t, m.t2d, 500, "test")
    assert bool((m.draft_token_ids[1:] > m.draft_token_ids[:-1]).all())
    assert m.counts[m.t2d].min() >= m.counts[~m.t2d].max()


def test_vocab_mapping_rejects_ids_outside_vocab():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        build_vocab_mapping([ex([1, 99])], vocab_size=10, draft_vocab_size=4)


def test_stale_cache_is_never_reused(tmp_path):
    tok = chatml_tokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVO}])
    cache = tmp_path / "cache"
    calls = []

    def mapping():
        def factory():
            calls.append(1)
            return tokenize_file(tok, data)

        key = {"data": fingerprint_files([data]), "max_length": None}
        return cached_vocab_mapping(factory, len(tok), 4, cache, key)

    first = mapping()
    files = list(cache.iterdir())
    assert len(calls) == 1 and len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    again = mapping()  # same data: the file is read back, not rebuilt
    assert len(calls) == 1 and files[0].stat().st_mtime_ns == mtime
    assert torch.equal(again.d2t, first.d2t) and torch.equal(again.counts, first.counts)
    # new data, new key: recomputed into a new file, the old one left alone
    write_jsonl(data, [{"messages": CONVO}, {"question": "hello", "answer": "five five five five"}])
    changed = mapping()
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2
    assert int(changed.counts[tok.convert_tokens_to_ids("five")]) == 4
    assert tok.convert_tokens_to_ids("five") in changed.draft_token_ids.tolist()
    assert not torch.equal(changed.counts, first.counts)


def test_cache_file_under_another_key_or_corrupt_is_recomputed(tmp_path):
    from draftsman.train.vocab import cache_path

    calls = []

    def factory():
        calls.append(1)
        return [ex([1, 1, 2])]

    key = {"data": "abc"}
    path, _ = cache_path(tmp_path, 8, 2, key)
    path.write_bytes(b"not safetensors")
    m = cached_vocab_mapping(factory, 8, 2, tmp_path, key)
    assert len(calls) == 1 and m.draft_token_ids.tolist() == [1, 2]
    assert cached_vocab_mapping(factory, 8, 2, tmp_path, key).draft_token_ids.tolist() == [1, 2]
    assert len(calls) == 1
    # sizes are part of the key even when the caller forgets them
    cached_vocab_mapping(factory, 8, 3, tmp_path, key)
    assert len(calls) == 2


def test_fingerprint_files_tracks_contents(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("xy")
    b.write_text("z")
    h = fingerprint_files([a, b])
    assert h == fingerprint_files([str(a), str(b)]) and len(h) == 64
    assert fingerprint_files(a) == fingerprint_files([a])
    assert h != fingerprint_files([b, a])
    a.write_text("x")
    b.write_text("yz")  # same concatenation, different files
    assert fingerprint_files([a, b]) != h


def test_leading_assistant_turns(tmp_path):
    tok = chatml_tokenizer()
    opening = [{"role": "assistant", "content": "one"}, *CONVO[1:3]]
    with pytest.raises(LossMaskError, match="opens the conversation"):
        tokenize_conversation(tok, opening)
    # ShareGPT chunks that start mid-dialogue: tokenize_file drops the unanswerable opening turn
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": opening}])
    (out,) = tokenize_file(tok, path)
    assert out == tokenize_conversation(tok, CONVO[1:3])


def test_tokenize_file_on_shared_sharegpt_head(llama3_tokenizer):
    from conftest import SHARED

    path = SHARED / "data/train/sharegpt_v3_partial.jsonl.gz"
    if not path.exists():
        pytest.skip("shared data not present")
    out = tokenize_file(llama3_tokenizer, path, max_length=512, num_samples=40)
    assert len(out) == 40 and all(len(e.input_ids) <= 512 and any(e.loss_mask) for e in out)
