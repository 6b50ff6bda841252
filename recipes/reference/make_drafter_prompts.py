"""Prompts for the reference drafter's training data: the user turns of ../shared/data/train
(ShareGPT, GPTeacher, GSM8K train; never the eval sets), first turn only, as OpenAI-style
records for `draftsman prepare-data`, which has the reference target write every answer.

    python recipes/reference/make_drafter_prompts.py --data ../shared/data/train --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from refdata import is_validation, iter_conversations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/train")
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-source", type=int, default=4000, help="at most this many prompts per source")
    ap.add_argument("--max-chars", type=int, default=3000, help="skip prompts longer than this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=["shuffle", "length"], default="shuffle",
                    help="length: shortest prompts first, so prepare-data's batches pad little (the "
                         "trainer shuffles anyway)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    by_source: dict[str, list[dict]] = {}
    for conv in iter_conversations(args.data):
        if is_validation(conv["id"]):  # the target's held-out split stays unseen here too
            continue
        msgs = conv["messages"]
        system = msgs[:1] if msgs[0]["role"] == "system" else []
        user = next((m for m in msgs if m["role"] == "user"), None)
        head = [*system, user] if user else []
        if not head or sum(len(m["content"]) for m in head) > args.max_chars:
            continue
        by_source.setdefault(conv["source"], []).append({"id": conv["id"], "messages": head})
    chosen = []
    for records in by_source.values():
        rng.shuffle(records)
        chosen += records[: args.per_source]
    rng.shuffle(chosen)
    if args.order == "length":
        chosen.sort(key=lambda r: sum(len(m["content"]) for m in r["messages"]))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in chosen))
    print(json.dumps({"prompts": len(chosen), "by_source": Counter(r["id"].split(":")[0] for r in chosen)}))


if __name__ == "__main__":
    main()
