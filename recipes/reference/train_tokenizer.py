"""Train the reference target's tokenizer: byte-level BPE (HF `tokenizers`) with chat specials.

    python recipes/reference/train_tokenizer.py --data ../shared/data/train --out recipes/reference/out/tokenizer

Trains on the user/assistant/system text of the *train* split of ../shared/data/train (the
held-out validation conversations and ../shared/data/eval are never seen) and saves with
transformers' PreTrainedTokenizerFast, so ``AutoTokenizer.from_pretrained(out)`` works offline.

Chat format (ChatML-like, one special token per role, no newlines added):

    <|bos|><|system|>You are ...<|eos|><|user|>Hi<|eos|><|assistant|>Hello!<|eos|>

``<|eos|>`` ends every turn (and the text); the generation prompt is ``<|assistant|>``, so
rendering messages[:i] with add_generation_prompt=True is a string prefix of rendering
messages[:i+1], and the prefix always ends on a special token (token boundaries agree).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import refdata

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS.values()]  # ids 0..5, in this order

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('unknown role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain `tokenizer(text)` starts with <|bos|> as every training document does; the chat
    # template writes its own <|bos|> and is encoded with add_special_tokens=False.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    return tok


def wrap(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=model_max_length, padding_side="left", clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def check(out: Path) -> dict:
    """Reload from disk and check what draftsman relies on; returns a few facts for the log."""
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(str(out))
    assert (tk.bos_token, tk.eos_token, tk.pad_token) == (BOS, EOS, PAD), tk
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": " Hello!\n"}, {"role": "user", "content": "Sort [3, 1]?"},
            {"role": "assistant", "content": "sorted([3, 1]) == [1, 3]"}]
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tk.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=False)
        full = tk.apply_chat_template(msgs[: i + 1], tokenize=False)
        assert full.startswith(prompt) and full.endswith(EOS), (prompt, full)
        p_ids = tk.encode(prompt, add_special_tokens=False)
        f_ids = tk.encode(full, add_special_tokens=False)
        assert f_ids[: len(p_ids)] == p_ids and f_ids[-1] == tk.eos_token_id
    text = "How do I sort a list in Python? Use sorted(xs) or xs.sort().  \n\tDone: 1234 ünïcödé 日本"
    assert tk.decode(tk.encode(text, add_special_tokens=False)) == text
    assert tk.encode("hi")[0] == tk.bos_token_id
    return {"vocab_size": len(tk), "special_ids": {t: tk.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
            "example": full}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/train", help="folder of the training JSONL files")
    ap.add_argument("--out", default="recipes/reference/out/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--val-percent", type=float, default=1.0, help="held-out share (same split as pretraining)")
    ap.add_argument("--limit", type=int, default=None, help="toy runs: keep every n-th conversation")
    ap.add_argument("--model-max-length", type=int, default=2048)
    args = ap.parse_args(argv)
    if not 8192 <= args.vocab_size <= 16384:
        ap.error("--vocab-size must lie in 8k..16k (the reference target's design)")

    t0 = time.time()
    train, _ = refdata.load_split(args.data, args.val_percent, args.limit)
    texts = list(refdata.message_texts(train))
    print(f"{len(train)} train conversations, {len(texts)} messages, "
          f"{sum(map(len, texts)) / 1e6:.1f}M characters ({time.time() - t0:.1f}s)", flush=True)
    tok = train_tokenizer(texts, args.vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False: the chat template goes into tokenizer_config.json, where every
    # transformers version (and SGLang / vLLM) reads it, not only into chat_template.jinja.
    wrap(tok, args.model_max_length).save_pretrained(str(out), save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4.x and 5.x both know
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    facts = check(out)
    facts.update(seconds=round(time.time() - t0, 1), data=str(args.data), limit=args.limit,
                 command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]))
    (out / "tokenizer_train.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps({k: v for k, v in facts.items() if k != "example"}))


if __name__ == "__main__":
    main()
