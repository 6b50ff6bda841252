"""The embedded reference pair on the four prompt sets: τ, per-position acceptance and speed-up of
a chain and two trees over plain decoding, at T=0 and T=1, measured by `draftsman bench` (each
(set, temperature) is one bench run, so every speed-up compares arms of the same run).

    python benchmarks/reference_pair.py --device cpu --out benchmarks/results/reference_pair_cpu.json
    python benchmarks/reference_pair.py --device cuda --out benchmarks/results/reference_pair_h200.json

Prints one JSON line: {"device", "runs": [{"dataset", "temperature", "arm", "accept_length",
"accept_rate_per_position", "tokens_per_s", "speedup", "identical"}...]}; --out also keeps every
bench run's full JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

# chain of 5, a 6-node tree and the engine's default tree (SGLang meanings: steps, topk, nodes)
SPECS = {"--spec-steps": "5", "--spec-topk": "1,4", "--spec-draft-tokens": "6,16"}


def run_bench(flags: list[str], target: str | None = None, drafter: str | None = None) -> tuple[dict, list[str]]:
    """One `draftsman bench --json` run of these flags with the SPECS arms, seed 0 and 2 warm-up
    requests, on the given pair (default: the embedded one): (its JSON, the command)."""
    if target is None:
        from draftsman import reference_pair

        target, drafter = (str(p) for p in reference_pair())
    warmup = [] if "--warmup" in flags else ["--warmup", "2"]
    cmd = [sys.executable, "-m", "draftsman.cli", "bench", "--target", target, "--drafter", drafter,
           "--seed", "0", *warmup, *flags, *(x for kv in SPECS.items() for x in kv), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def bench_once(args: argparse.Namespace, dataset: str, temperature: float) -> dict:
    return run_bench(["--dataset", dataset, "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                      str(args.max_new_tokens), "--temperature", str(temperature), "--device", args.device],
                     args.target, args.drafter)[0]


def summarize(result: dict) -> list[dict]:
    return [{
        "dataset": result["dataset"], "temperature": result["temperature"], "arm": arm["arm"],
        "accept_length": arm["accept_length"], "accept_rate_per_position": arm["accept_rate_per_position"],
        "tokens_per_s": arm["tokens_per_s"], "speedup": arm["speedup"],
        "identical": result["identical"] if arm["kind"] == "spec" else None,
    } for arm in result["arms"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--datasets", default="mt-bench,humaneval,gsm8k,alpaca")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--target", help="default: the embedded reference target")
    ap.add_argument("--drafter", help="default: the embedded reference drafter")
    ap.add_argument("--out", help="write every bench run's full JSON here")
    args = ap.parse_args()
    if (args.target is None) != (args.drafter is None):
        ap.error("give both --target and --drafter, or neither (the embedded pair)")
    full, rows = [], []

    def summary() -> dict:
        return {"device": full[0]["device"] if full else args.device, "num_prompts": args.num_prompts,
                "max_new_tokens": args.max_new_tokens, "runs": rows}

    for dataset in args.datasets.split(","):
        for t in (float(x) for x in args.temperatures.split(",")):
            result = bench_once(args, dataset, t)
            full.append(result)
            new = summarize(result)
            rows += new
            print(f"{dataset} T={t}: " + ", ".join(
                f"{r['arm']} tau={r['accept_length']} x{r['speedup']}" for r in new), file=sys.stderr)
            # after every run, so a run cut short keeps what it measured
            write_results(args.out, {"summary": summary(), "bench": full})
    print(json.dumps(summary()))


if __name__ == "__main__":
    main()
