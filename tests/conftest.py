"""Shared fixtures: tiny HF checkpoints written with transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"


def save_hf(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 4-layer Llama with llama3 RoPE scaling (shared by several test files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    )
    return save_hf(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama"))
