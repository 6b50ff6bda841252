"""Batch scaling of speculation with the embedded reference pair: plain decoding, fixed chain and
tree settings, and adaptive speculation (`--spec-adaptive`) at batch 1, 4, 16, 64, one
`draftsman bench` run (so every speed-up compares arms of the same run).

    python benchmarks/h200_batch.py --out benchmarks/results/h200_batch.json --h200-json benchmarks/h200.json

Prints one JSON line: per batch size each arm's tokens/s and speed-up, and
`min_speedup_over_batches` (the adaptive arm's lowest speed-up over the batch sizes; the issue's
goal is >= 1.0) beside each fixed arm's.

With 64 prompts, batch 64 is one wave: every request starts at once and none refills a slot, so
the run ends with the slowest rows decoding alone (under speculation rows finish apart). For
throughput with the batch kept full, --steady runs batch 16 and 64 over the four bundled prompt
sets interleaved (320 prompts, 128 of them as the warm-up):

    python benchmarks/h200_batch.py --steady --out benchmarks/results/h200_batch_steady.json --h200-json benchmarks/h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

from h200_json import (  # benchmarks/ is on sys.path when run as a script
    update_h200_json,
    write_results,
)
from reference_pair import run_bench


def mixed_prompts(path: Path) -> int:
    """The bundled prompt sets interleaved one prompt at a time into one JSONL file: how many."""
    from draftsman.bench import PROMPT_SETS, load_prompt_set

    sets = [load_prompt_set(name) for name in PROMPT_SETS]
    mixed = [p for group in itertools.zip_longest(*sets) for p in group if p is not None]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in mixed))
    return len(mixed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up requests per arm (default: all prompts, so the graphs of every batch bucket and "
                         "attention span the timed run meets are captured before it, as in a long-running server)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", default="0")
    ap.add_argument("--out")
    ap.add_argument("--h200-json")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="draftsman bench --eager-prefill (newcomers prefilled eagerly, as before staged prefills)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="draftsman bench --repeats: timed runs per arm, interleaved, the median's reported "
                         "(default 3: on the H200 a plain arm's batch-64 run read 1.51 and 1.76 ms a step in two "
                         "calls, and the arms of one call run minutes apart)")
    ap.add_argument("--warmup-passes", type=int, default=5,
                    help="draftsman bench --warmup-passes (warm-ups repeat while they capture graphs; 5: in "
                         "session 12 the adaptive arm at batch 16 still captured in its third and in the timed run)")
    ap.add_argument("--steady", action="store_true",
                    help="batch 16 and 64 over the four prompt sets interleaved (320 prompts, warm-up 128): "
                         "the batch stays full, refilled as requests finish")
    args = ap.parse_args()
    if args.steady:
        mix = Path(tempfile.mkdtemp()) / "mixed_prompts.jsonl"
        args.num_prompts, args.dataset = mixed_prompts(mix), str(mix)
        args.batch_sizes = "16,64" if args.batch_sizes == ap.get_default("batch_sizes") else args.batch_sizes
        args.warmup = 128 if args.warmup is None else args.warmup
    result, cmd = run_bench(["--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
                             "--max-new-tokens", str(args.max_new_tokens), "--temperature", args.temperature,
                             "--device", args.device, "--batch-sizes", args.batch_sizes, "--spec-adaptive",
                             "--warmup", str(args.num_prompts if args.warmup is None else args.warmup),
                             "--warmup-passes", str(args.warmup_passes), "--repeats", str(args.repeats),
                             *(["--eager-prefill"] if args.eager_prefill else [])])
    by_batch: dict = {}
    for a in result["arms"]:
        by_batch.setdefault(str(a["batch_size"]), {})[a["arm"]] = {
            "tokens_per_s": a["tokens_per_s"], "speedup": a["speedup"], "accept_length": a["accept_length"],
            "identical": a["identical"], "adaptive": a["adaptive"], "graph_captures": a["graph_captures"],
            "warmup_passes_run": a["warmup_passes"], "catch_ups": a["catch_ups"], "catch_up_s": a["catch_up_s"],
            "durations_s": a["durations_s"],
            **{k: a[k] for k in ("duration_s", "session_steps", "time_in_steps_s", "joins", "time_in_joins_s",
                                 "time_elsewhere_s")}}
    arms = [a for a in by_batch[str(result["batch_sizes"][0])] if a != "plain"]
    minimum = {a: min(b[a]["speedup"] for b in by_batch.values()) for a in arms}
    summary = {"device": result["device"], "dtype": result["dtype"],
               "dataset": "mt-bench+humaneval+gsm8k+alpaca, interleaved" if args.steady else args.dataset,
               "steady": args.steady,
               "temperature": float(args.temperature), "num_prompts": args.num_prompts,
               "max_new_tokens": args.max_new_tokens, "eager_prefill": args.eager_prefill,
               "warmup_passes": args.warmup_passes, "repeats": args.repeats,
               "warmup": args.num_prompts if args.warmup is None else args.warmup, "by_batch": by_batch, "min_speedup": minimum,
               "min_speedup_over_batches": minimum["spec-adaptive"], "command": " ".join(cmd[1:])}
    write_results(args.out, {"summary": summary, "bench": result})
    if args.h200_json:
        key = "min_speedup_steady_batch_16_64" if args.steady else "min_speedup_over_batches"
        update_h200_json(args.h200_json, {key: minimum["spec-adaptive"], f"{key}_fixed": minimum},
                         args.out or "(not saved)")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
