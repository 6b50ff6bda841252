"""Drafter training on P processes of one host (torchrun: DDP, FSDP2) against one process with the
same global batch (issue 8): per-step losses, tokens/s and scaling efficiency, for online
training (the target in the loop) and offline training (states dumped first), and the τ the
trained drafters reach when they speculate.

    # the run issue 8 asks for, on a host with 2 GPUs (NCCL, NVLink multicast off):
    python benchmarks/train_scaling.py --data train.jsonl --nproc 2 \\
        --out benchmarks/results/train_scaling_2x_h200.json
    # the single-GPU baseline alone (--nproc 1), or a CPU check over gloo:
    python benchmarks/train_scaling.py --data train.jsonl --device cpu --steps 3 --batch-size 8

--data: conversations in `draftsman prepare-data`'s layout, written by the target (the
reference drafter's were: `draftsman prepare-data` on ShareGPT/GPTeacher/GSM8K prompts).
--target defaults to the embedded reference target, and --init to its drafter (so τ means
something after a short run; --init none trains from scratch). Every arm trains from the same seed over
the same global batches (--batch-size sequences per optimizer step, whatever P is), so losses
must agree step for step (to bf16 tolerance on CUDA: the trainer autocasts to bf16).
tokens/s = tokens of the global batches / wall time of the steps, rank 0's clock (every step
ends in collectives), over the steps after --skip-steps (allocator and kernel warm-up).
Scaling efficiency = tokens/s on P processes / (P x tokens/s on one). τ: `draftsman bench`
(greedy, MT-bench, --tau-prompts prompts, tree of 16 with 5 steps) with each trained drafter;
a short run's τ is low, but must match the one-process drafter's.

Prints one JSON line (the commands it ran included); --out keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

from draftsman.reference import DRAFTER_DIR, TARGET_DIR

MODES = {"ddp": [], "fsdp": ["--fsdp"]}


def log(msg: str) -> None:
    print(f"[train_scaling] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], env: dict[str, str], what: str) -> tuple[str, float]:
    """Run cmd; return its stdout and wall seconds. A failure stops the benchmark with its output."""
    log(f"{what}: {shlex.join(cmd)}")
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"{what} failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout, time.perf_counter() - t


def train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def throughput(records: list[dict], skip: int) -> dict:
    """Global tokens/s over the steps after `skip` (all steps if fewer remain)."""
    timed = records[skip:] or records
    tokens, seconds = sum(r["tokens"] for r in timed), sum(r["time_s"] for r in timed)
    return {"tokens_per_s": tokens / seconds, "timed_steps": len(timed), "tokens": tokens, "seconds": seconds}


def loss_agreement(one: list[dict], many: list[dict]) -> dict:
    """Largest relative difference of the step losses, and whether the steps saw the same positions."""
    rel = [abs(b["loss"] - a["loss"]) / max(abs(a["loss"]), 1e-12) for a, b in zip(one, many, strict=True)]
    same = all(a["positions_per_step"] == b["positions_per_step"] for a, b in zip(one, many, strict=True))
    return {"loss_max_rel_diff": max(rel), "same_positions": same}


def measured_tau(target: Path, drafter: Path, args, env: dict[str, str]) -> tuple[float | None, str]:
    cmd = [sys.executable, "-m", "draftsman.cli", "bench", "--target", str(target), "--drafter", str(drafter),
           "--dataset", "mt-bench", "--num-prompts", str(args.tau_prompts), "--max-new-tokens",
           str(args.tau_new_tokens), "--temperature", "0", "--spec-steps", "5", "--spec-topk", "4",
           "--spec-draft-tokens", "16", "--device", args.device, "--json"]
    out, _ = run(cmd, env, f"tau of {drafter.name}")
    return json.loads(out.strip().splitlines()[-1])["accept_length"], shlex.join(cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepare-data JSONL conversations")
    ap.add_argument("--target", default=str(TARGET_DIR), help="HF target directory (default: the reference target)")
    ap.add_argument("--init", help="drafter to finetune (default: the reference drafter with the reference target; "
                                   "none: from scratch)")
    ap.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the parallel arms; 1: baseline only")
    ap.add_argument("--modes", default="ddp,fsdp", help="parallel arms, comma list of ddp, fsdp")
    ap.add_argument("--inputs", default="online,offline", help="online (target in the loop), offline (dumped states)")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per arm")
    ap.add_argument("--skip-steps", type=int, default=3, help="first steps left out of tokens/s")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch in sequences")
    ap.add_argument("--micro-batch-size", type=int, default=16, help="sequences per forward per process")
    ap.add_argument("--max-length", type=int, default=768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--train-args", default="", help="more `draftsman train` arguments for every arm (one string)")
    ap.add_argument("--loss-rtol", type=float, help="losses agree within this (default 2e-2 on CUDA: bf16; 1e-4 on CPU)")
    ap.add_argument("--tau-prompts", type=int, default=10, help="MT-bench prompts for τ (0: no τ)")
    ap.add_argument("--tau-new-tokens", type=int, default=128)
    ap.add_argument("--work", default="/tmp/draftsman-train-scaling", help="runs and dumped states go here")
    ap.add_argument("--out")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m] if args.nproc > 1 else []
    inputs = [i for i in args.inputs.split(",") if i]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (ddp, fsdp)")
    for i in inputs:
        if i not in ("online", "offline"):
            ap.error(f"--inputs: unknown input {i!r} (online, offline)")
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.nproc:
        ap.error(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPU(s) visible")
    init = args.init or (str(DRAFTER_DIR) if Path(args.target).resolve() == TARGET_DIR.resolve() else "none")
    rtol = args.loss_rtol if args.loss_rtol is not None else (2e-2 if args.device.startswith("cuda") else 1e-4)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # NVLink multicast (NVLS) off, as the device notes ask; one CPU thread per process off CUDA.
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    if not args.device.startswith("cuda"):
        env["OMP_NUM_THREADS"] = "1"
    num_samples = args.steps * args.batch_size
    res: dict = {"device": args.device, "gpus": [torch.cuda.get_device_name(i) for i in range(args.nproc)]
                 if args.device.startswith("cuda") else None, "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "nproc": args.nproc, "steps": args.steps,
                 "skip_steps": args.skip_steps, "batch_size": args.batch_size,
                 "micro_batch_size": args.micro_batch_size, "max_length": args.max_length, "loss_rtol": rtol,
                 "target": args.target, "init": init, "data": args.data, "commands": {}, "runs": {}, "figures": {}}

    def save() -> None:
        write_results(args.out, res)

    base = ["train", "--target", args.target, "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--micro-batch-size", str(args.micro_batch_size), "--max-length", str(args.max_length),
            "--num-samples", str(num_samples), "--seed", "0", "--device", args.device, "--save-every", "0",
            "--no-progress", *([] if init == "none" else ["--init", init]), *shlex.split(args.train_args)]
    for source in inputs:
        if source == "offline":
            states = work / "states"
            cmd = [sys.executable, "-m", "draftsman.cli", "dump-hidden", "--target", args.target, "--data", args.data,
                   "--out", str(states), "--max-length", str(args.max_length), "--num-samples", str(num_samples),
                   "--device", args.device]
            _, seconds = run(cmd, env, "dump-hidden")
            res["commands"]["dump-hidden"] = shlex.join(cmd)
            res["dump_hidden_s"] = seconds
            data = ["--hidden-dir", str(states)]
        else:
            data = ["--data", args.data]
        runs, figs, logs = {}, {}, {}
        for arm in ["single", *modes]:
            out = work / f"{source}-{arm}"
            train = [*base, *data, "--out", str(out), *MODES.get(arm, [])]
            if arm == "single":
                cmd = [sys.executable, "-m", "draftsman.cli", *train]
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                       "-m", "draftsman.cli", *train]
            _, wall = run(cmd, env, f"{source} {arm}")
            records = logs[arm] = train_log(out)
            runs[arm] = {"wall_s": wall, "losses": [r["loss"] for r in records], **throughput(records, args.skip_steps)}
            res["commands"][f"{source}-{arm}"] = shlex.join(cmd)
            if args.tau_prompts > 0:
                runs[arm]["tau"], res["commands"][f"tau-{source}-{arm}"] = measured_tau(Path(args.target), out, args,
                                                                                        env)
            if arm != "single":
                one = runs["single"]
                agree = loss_agreement(logs["single"], records)
                figs[arm] = {"scaling_efficiency": runs[arm]["tokens_per_s"] / (args.nproc * one["tokens_per_s"]),
                             **agree, "losses_match": agree["loss_max_rel_diff"] <= rtol and agree["same_positions"],
                             "tau": runs[arm].get("tau"), "tau_single": one.get("tau")}
            res["runs"][source], res["figures"][source] = runs, figs
            save()
    save()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
