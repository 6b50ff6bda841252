"""The embedded reference pair: the target is an ordinary HF checkpoint that draftsman and
transformers compute identically; the drafter loads against it and speculation with it is
lossless and accepts what it was measured to accept; `draftsman demo` on it and on other pairs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import draftsman
from draftsman.reference import DRAFTER_DIR, TARGET_DIR, reference_pair
from draftsman.tokenizer import encode_prompt, load_tokenizer


def test_reference_target_matches_transformers():
    tok = load_tokenizer(TARGET_DIR)
    ids = torch.tensor([encode_prompt(tok, "How do I sort a list in Python?", chat=True)])
    hf = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    ours = draftsman.load_target(TARGET_DIR)
    assert ours.config.architecture == "DeepseekV3ForCausalLM" and ours.config.mla is not None
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4


def test_reference_pair_names_what_is_missing(monkeypatch, tmp_path):
    assert reference_pair() == (TARGET_DIR, DRAFTER_DIR)
    monkeypatch.setattr("draftsman.reference.DRAFTER_DIR", tmp_path / "reference-drafter")
    with pytest.raises(FileNotFoundError, match="reference-drafter"):
        reference_pair()


def test_reference_drafter_is_lossless_on_its_target():
    from draftsman.generate import StopRules, generate_plain
    from draftsman.models.eagle3 import load_drafter
    from draftsman.spec.engine import SpecConfig, SpecEngine

    target = draftsman.load_target(TARGET_DIR)
    drafter = load_drafter(DRAFTER_DIR, target=target)
    assert drafter.aux_layer_ids == (2, 4, 5)  # the default [2, L//2, L-3] of an 8-layer target
    tok = load_tokenizer(TARGET_DIR)
    prompts = [encode_prompt(tok, t, chat=True) for t in ("Write a haiku about rain.", "What is 7 times 8?")]
    rules = StopRules(40, frozenset({1}))
    plain = generate_plain(target, prompts, rules).token_ids
    for spec in (SpecConfig.chain(4), SpecConfig()):
        assert SpecEngine(target, drafter, spec).generate(prompts, rules).token_ids == plain


def test_demo_json_on_the_reference_pair():
    """The README's main command. Floor: the recorded CPU run of these six prompts measured
    tau 4.25 with the default tree (fp32, deterministic greedy); 3.0 leaves room for another
    CPU's rounding and is still far above what a mis-wired drafter reaches (about 1-1.5)."""
    res = subprocess.run([sys.executable, "-m", "draftsman.cli", "demo", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["identical"] is True
    assert out["accept_length"] >= 3.0
    assert len(out["accept_rate_per_position"]) == 5 and out["accept_rate_per_position"][0] > 0.6
    assert out["plain_tokens_per_s"] > 0 and out["spec_tokens_per_s"] > 0


def test_demo_json_on_a_tiny_pair(tiny_llama_dir, tmp_path):
    from test_cli_generate import make_tokenizer

    from draftsman.models.eagle3 import init_drafter, save_drafter

    target_dir = shutil.copytree(tiny_llama_dir, tmp_path / "t")
    make_tokenizer(target_dir)
    save_drafter(init_drafter(draftsman.load_target(target_dir), seed=0), tmp_path / "d")
    res = subprocess.run([sys.executable, "-m", "draftsman.cli", "demo", "--target", str(target_dir),
                          "--drafter", str(tmp_path / "d"), "--prompt", "hello world", "--prompt", "how are you",
                          "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["identical"] is True
    assert out["num_prompts"] == 2 and out["new_tokens"] > 0
    assert out["speedup"] == pytest.approx(out["spec_tokens_per_s"] / out["plain_tokens_per_s"], rel=1e-2)
    # tau = 1 + sum of per-position rates holds for trees too (p_i = rounds accepting >= i)
    assert out["accept_length"] == pytest.approx(1 + sum(out["accept_rate_per_position"]), abs=1e-3)
