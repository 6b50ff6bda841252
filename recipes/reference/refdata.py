"""The reference target's training data: ../shared/data/train normalised to chat conversations.

Every source becomes ``{"id", "source", "messages": [{"role", "content"}, ...]}`` with roles
``system`` / ``user`` / ``assistant``; the split into train and held-out validation is a
deterministic function of the conversation id, so the tokenizer, the pretraining run and any
later step agree on it. The eval sets (../shared/data/eval) are never read here.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

SOURCES = {
    "sharegpt": "sharegpt_v3_partial.jsonl.gz",
    "gpteacher_codegen": "gpteacher_codegen_instruct.jsonl",
    "gpteacher_roleplay": "gpteacher_roleplay_instruct.jsonl",
    "gpteacher_toolformer": "gpteacher_toolformer_dedupe.jsonl",
    "gsm8k": "gsm8k_train.jsonl",
}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user",
                  "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
_CALC = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 48/2 = <<48/2=24>>24


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _sharegpt(rec: dict) -> list[dict] | None:
    """Map roles, merge consecutive turns of one role, drop assistant turns before the first user
    turn (truncated splits start mid-conversation) and a final unanswered user turn."""
    msgs: list[dict] = []
    for turn in rec.get("conversations") or []:
        role = SHAREGPT_ROLES.get(turn.get("from"))
        text = (turn.get("value") or "").strip()
        if role is None or not text:
            continue
        if role == "system" and msgs:
            role = "user"  # a system turn mid-conversation: keep the text as a user turn
        if msgs and msgs[-1]["role"] == role:
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": role, "content": text})
    head = [m for m in msgs[:1] if m["role"] == "system"]
    body = msgs[len(head):]
    while body and body[0]["role"] != "user":
        body.pop(0)
    while body and body[-1]["role"] != "assistant":
        body.pop()
    return head + body if body else None


def _instruction(rec: dict) -> list[dict] | None:
    prompt = (rec.get("instruction") or "").strip()
    extra = (rec.get("input") or "").strip()
    if extra:
        prompt = f"{prompt}\n\n{extra}"
    answer = (rec.get("response") or "").strip()
    if not prompt or not answer:
        return None
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _gsm8k(rec: dict) -> list[dict] | None:
    answer = _CALC.sub("", rec["answer"]).strip()
    return [{"role": "user", "content": rec["question"].strip()}, {"role": "assistant", "content": answer}]


def iter_conversations(data_dir: str | Path) -> Iterator[dict]:
    data_dir = Path(data_dir)
    for source, name in SOURCES.items():
        path = data_dir / name
        if not path.exists():
            raise FileNotFoundError(f"{path}: missing training file (see ../shared/data/README.md)")
        convert = _sharegpt if source == "sharegpt" else _gsm8k if source == "gsm8k" else _instruction
        for i, rec in enumerate(_read_jsonl(path)):
            msgs = convert(rec)
            if msgs:
                yield {"id": f"{source}:{rec.get('id', i)}:{i}", "source": source, "messages": msgs}


def is_validation(conv_id: str, percent: float = 1.0) -> bool:
    """The deterministic ~percent% held-out split, by a hash of the conversation id."""
    h = int.from_bytes(hashlib.sha1(conv_id.encode()).digest()[:8], "big")
    return (h % 10_000) < percent * 100


def load_split(data_dir: str | Path, val_percent: float = 1.0, limit: int | None = None):
    """(train, validation) conversation lists. `limit` keeps every n-th record for toy runs."""
    train, val = [], []
    for k, conv in enumerate(iter_conversations(data_dir)):
        if limit and k % max(1, limit) != 0:
            continue
        (val if is_validation(conv["id"], val_percent) else train).append(conv)
    return train, val


def message_texts(convs) -> Iterator[str]:
    for conv in convs:
        for m in conv["messages"]:
            yield m["content"]
