"""Is the default never slower than plain decoding? `draftsman bench` with its default arms
(plain decoding, the adaptive policy's three candidates as fixed settings, and `spec-adaptive`,
what generate, demo and serve decode with by default) over prompt sets x temperatures x batch
sizes, one bench run per (set, temperature), so every ratio compares arms of the same run.
Every request generates exactly --max-new-tokens (bench --ignore-eos; --stop-at-eos to not):
at T > 0 the arms sample different answers, and answers ending at different lengths would give
the arms different work.

    python benchmarks/never_slower.py --device cpu --batch-sizes 1,4 \\
        --out benchmarks/results/never_slower_cpu_reference.json --plot benchmarks/results/never_slower_cpu_reference.png
    python benchmarks/never_slower.py --device cuda --batch-sizes 1,4,16,64 --target DIR --drafter DIR ...

The goals it checks (issue 28): the adaptive arm's speed-up over plain decoding >= 0.97 in every
configuration, and at T=0, batch 1 no more than 5% below the best fixed setting of the same run.
A grid split over several runs (device calls have a time limit: one --datasets each) is
combined with `--merge FILE ... --out ... --plot ...`. Prints one JSON line: {"device", "pair", "min_adaptive_speedup", "worst", "t0_bs1_vs_best_fixed"
(the lowest over the sets), "goals": {...}, "runs": [one row per (set, T, batch size)]}; --out
keeps the rows and every bench run's full JSON, --plot draws the adaptive arm's speed-up against
temperature (a panel per set, a line per batch size, the best fixed setting dashed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

ADAPTIVE = "spec-adaptive"


def run_bench(args: argparse.Namespace, dataset: str, temperature: float) -> tuple[dict, list[str]]:
    """One `draftsman bench --json` run with its default arms: (its JSON, the command)."""
    pair = ["--target", args.target, "--drafter", args.drafter]
    if args.target is None:
        from draftsman import reference_pair

        pair = [x for kv in zip(("--target", "--drafter"), map(str, reference_pair()), strict=True) for x in kv]
    cmd = [sys.executable, "-m", "draftsman.cli", "bench", *pair, "--seed", "0", "--dataset", dataset,
           "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", str(temperature), "--device", args.device, "--batch-sizes", args.batch_sizes,
           "--warmup", str(args.warmup), "--warmup-passes", str(args.warmup_passes), "--repeats", str(args.repeats),
           *([] if args.stop_at_eos else ["--ignore-eos"]),
           *([] if args.join_wait_rounds is None else ["--join-wait-rounds", str(args.join_wait_rounds)]), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def rows_of(result: dict) -> list[dict]:
    """Per batch size: the adaptive arm against plain decoding and against the best fixed arm."""
    out = []
    for bs in result["batch_sizes"]:
        arms = {a["arm"]: a for a in result["arms"] if a["batch_size"] == bs}
        adaptive = arms[ADAPTIVE]
        fixed = {name: a for name, a in arms.items() if a["kind"] == "spec" and name != ADAPTIVE}
        best = max(fixed, key=lambda name: fixed[name]["tokens_per_s"])
        out.append({
            "dataset": result["dataset"], "temperature": result["temperature"], "batch_size": bs,
            "join_wait_rounds": result.get("join_wait_rounds"),
            "adaptive_speedup": adaptive["speedup"], "best_fixed_arm": best,
            "best_fixed_speedup": fixed[best]["speedup"],
            "adaptive_vs_best_fixed": adaptive["tokens_per_s"] / fixed[best]["tokens_per_s"],
            "fixed_speedups": {name: a["speedup"] for name, a in fixed.items()},
            "spec_rounds": adaptive["spec_rounds"], "plain_rounds": adaptive["plain_rounds"],
            "adaptive_accept_length": adaptive["accept_length"],
            "fixed_accept_lengths": {name: a["accept_length"] for name, a in fixed.items()},
            "plain_tokens_per_s": arms["plain"]["tokens_per_s"],
            # where the adaptive arm's time went beside plain decoding's (its drafter's work)
            "joins_s": {"adaptive": adaptive["time_in_joins_s"], "plain": arms["plain"]["time_in_joins_s"]},
            "joins": {"adaptive": adaptive.get("joins"), "plain": arms["plain"].get("joins")},
            "steps_s": {"adaptive": adaptive["time_in_steps_s"], "plain": arms["plain"]["time_in_steps_s"]},
            "drafter_work": {k: adaptive.get(k) for k in ("catch_ups", "catch_up_s", "deferred_prefills", "spills")},
            "identical": adaptive["identical"],
        })
    return out


def summarize(rows: list[dict], args: argparse.Namespace, device: str) -> dict:
    worst = min(rows, key=lambda r: r["adaptive_speedup"])
    t0 = [r for r in rows if r["temperature"] == 0 and r["batch_size"] == 1]
    t0_worst = min((r["adaptive_vs_best_fixed"] for r in t0), default=None)
    return {
        "device": device, "pair": "reference" if args.target is None else {"target": args.target,
                                                                         "drafter": args.drafter},
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "ignore_eos": not args.stop_at_eos,
        "warmup": args.warmup,
        "min_adaptive_speedup": worst["adaptive_speedup"],
        "worst": {k: worst[k] for k in ("dataset", "temperature", "batch_size")},
        "t0_bs1_vs_best_fixed": t0_worst,
        "goals": {"min_speedup_at_least_0.97": worst["adaptive_speedup"] >= 0.97,
                  "t0_bs1_within_5pct_of_best_fixed": None if t0_worst is None else t0_worst >= 0.95},
        "identical": all(r["identical"] is not False for r in rows),
        "runs": rows,
    }


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for i, bs in enumerate(sorted({r["batch_size"] for r in rows})):
            pts = sorted((r["temperature"], r["adaptive_speedup"], r["best_fixed_speedup"]) for r in rows
                         if r["dataset"] == name and r["batch_size"] == bs)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"adaptive, batch {bs}")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color, alpha=0.6,
                    label=f"best fixed, batch {bs}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.97, color="red", lw=0.6, ls=":")
        ax.set_title(name)
        ax.set_xlabel("temperature")
    axes[0][0].set_ylabel("speed-up over plain decoding")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(args: argparse.Namespace) -> None:
    """--merge: the files' rows, commands and bench runs as one record; the settings of the first
    file's summary (every file must share them)."""
    parts = [json.loads(Path(path).read_text()) for path in args.merge]
    first = parts[0]["summary"]
    keys = ("device", "pair", "num_prompts", "max_new_tokens", "repeats", "ignore_eos", "warmup")
    for path, part in zip(args.merge, parts, strict=True):
        differ = [k for k in keys if part["summary"].get(k) != first.get(k)]
        if differ:
            sys.exit(f"--merge: {path} differs from {args.merge[0]} in {', '.join(differ)}")
    rows = [r for part in parts for r in part["summary"]["runs"]]
    ns = argparse.Namespace(num_prompts=first["num_prompts"], max_new_tokens=first["max_new_tokens"],
                            repeats=first["repeats"], stop_at_eos=not first["ignore_eos"], warmup=first["warmup"],
                            target=None if first["pair"] == "reference" else first["pair"]["target"],
                            drafter=None if first["pair"] == "reference" else first["pair"]["drafter"])
    summary = summarize(rows, ns, first["device"])
    write_results(args.out, {"summary": summary, "commands": [c for part in parts for c in part["commands"]],
                             "bench": [b for part in parts for b in part["bench"]], "merged_from": args.merge})
    if args.plot:
        plot(rows, args.plot, f"draftsman default (adaptive) vs plain, {first['device']}, "
             f"{'reference pair' if ns.target is None else ns.target}")
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", help="default: the embedded reference target")
    ap.add_argument("--drafter", help="default: the embedded reference drafter")
    ap.add_argument("--datasets", default="mt-bench,humaneval,gsm8k")
    ap.add_argument("--temperatures", default="0,0.7,1")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4, help="bench --warmup: untimed requests per arm first (the "
                    "adaptive arm's policy keeps what it measured, as a running server would)")
    ap.add_argument("--warmup-passes", type=int, default=3, help="bench --warmup-passes: warm-up passes per arm at "
                    "most, each after one that captured CUDA graphs (none off CUDA). The adaptive arm decodes its "
                    "second pass unlike its first (it measured the arms in the first), so its joins meet new prefill "
                    "shapes: with one pass, the H200's timed runs captured 4-6 graphs in its joins at batch 4-16, "
                    "0.2-0.3 s of one-off cost in runs of 0.5-0.9 s")
    ap.add_argument("--repeats", type=int, default=2, help="bench --repeats: timed runs per arm, interleaved")
    ap.add_argument("--stop-at-eos", action="store_true", help="let requests stop at EOS (by default bench runs "
                    "with --ignore-eos: at T > 0 the arms' answers differ, and so would their lengths and work)")
    ap.add_argument("--join-wait-rounds", type=int, help="bench --join-wait-rounds (default: bench's): freed "
                    "slots wait up to this many rounds to be refilled together; 0 joins at once")
    ap.add_argument("--out", help="write the rows and every bench run's full JSON here")
    ap.add_argument("--plot", help="write the speed-up plot (PNG) here")
    ap.add_argument("--merge", nargs="+", metavar="FILE", help="run nothing: combine the rows of earlier --out "
                    "files (a grid split over several device calls, same settings) into one --out and --plot")
    args = ap.parse_args()
    if args.merge:
        return merge(args)
    if (args.target is None) != (args.drafter is None):
        ap.error("give both --target and --drafter, or neither (the embedded pair)")
    full, rows, commands, device = [], [], [], args.device
    for dataset in args.datasets.split(","):
        for t in (float(x) for x in args.temperatures.split(",")):
            result, cmd = run_bench(args, dataset, t)
            full.append(result)
            commands.append(" ".join(cmd[1:]))
            device = result["device"]
            new = rows_of(result)
            rows += new
            print(f"{dataset} T={t}: " + ", ".join(
                f"bs {r['batch_size']} adaptive x{r['adaptive_speedup']:.3f} (best fixed {r['best_fixed_arm']} "
                f"x{r['best_fixed_speedup']:.3f}; {r['spec_rounds']} spec / {r['plain_rounds']} plain rounds)"
                for r in new), file=sys.stderr)
            # after every run, so a run cut short keeps what it measured
            write_results(args.out, {"summary": summarize(rows, args, device), "commands": commands, "bench": full})
    summary = summarize(rows, args, device)
    if args.plot:
        plot(rows, args.plot, f"draftsman default (adaptive) vs plain, {device}, "
             f"{'reference pair' if args.target is None else args.target}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
