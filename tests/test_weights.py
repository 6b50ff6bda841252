"""Checkpoint loading: sharded files and every bad-checkpoint error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import draftsman
from draftsman.weights import CheckpointError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads(tiny_llama_dir, tmp_path):
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ours = draftsman.load_target(tmp_path)
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4


def test_load_to_bf16(tiny_llama_dir):
    ours = draftsman.load_target(tiny_llama_dir, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.rotary.inv_freq.dtype == torch.float32  # rotary table stays fp32
    assert ours(torch.randint(0, 256, (1, 4))).dtype == torch.bfloat16


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.mlp\.up_proj\.weight"):
        draftsman.load_target(d)


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.mystery\.weight"):
        draftsman.load_target(d)


def test_shape_mismatch_names_both_shapes(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    _rewrite(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(63)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\[63\].*\[64\]"):
        draftsman.load_target(d)


def test_truncated_file_is_reported(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        draftsman.load_target(d)


def test_no_weights_and_missing_shard(tiny_llama_dir, tmp_path):
    d = _copy(tiny_llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        draftsman.load_target(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard-1\.safetensors"):
        draftsman.load_target(d)
