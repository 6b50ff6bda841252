"""The tau curve of a drafter's training run: held-out tau (eval_log.jsonl of `draftsman train
--eval-every`) against the training tokens seen so far (train_log.jsonl: loss positions, i.e.
target-written answer tokens, summed over steps), as a JSON table and a plot.

    python recipes/smollm2/tau_curve.py RUN_DIR --out tau_curve.json --plot tau_curve.png
"""

from __future__ import annotations

import argparse
import json
from itertools import accumulate
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(train_log: list[dict], eval_log: list[dict]) -> list[dict]:
    """One row per evaluation: step, answer tokens and sequence tokens trained on, tau (chain of
    depth ttt_steps, and independent steps), step-0 acceptance."""
    steps = sorted(train_log, key=lambda r: r["step"])
    answer = dict(zip((r["step"] for r in steps), accumulate(r["positions_per_step"][0] for r in steps), strict=True))
    seen = dict(zip((r["step"] for r in steps), accumulate(r["tokens"] for r in steps), strict=True))
    return [{"step": e["step"], "answer_tokens": answer[e["step"]], "sequence_tokens": seen[e["step"]],
             "tau_chain": e["tau_chain"], "tau_pred": e["tau_pred"], "acceptance_step0": e["acceptance_per_step"][0]}
            for e in eval_log if e["step"] in answer]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="holds train_log.jsonl and eval_log.jsonl")
    ap.add_argument("--out", required=True, help="JSON table")
    ap.add_argument("--plot", help="PNG (needs matplotlib)")
    args = ap.parse_args()
    run = Path(args.run_dir)
    rows = curve(read_jsonl(run / "train_log.jsonl"), read_jsonl(run / "eval_log.jsonl"))
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        x = [r["answer_tokens"] / 1e6 for r in rows]
        ax.plot(x, [r["tau_chain"] for r in rows], marker=".", label="tau, chain of 7 (joint)")
        ax.plot(x, [r["tau_pred"] for r in rows], marker=".", label="tau, independent steps")
        ax.set_xlabel("answer tokens trained on (millions)")
        ax.set_ylabel("held-out tau (teacher-forced)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
