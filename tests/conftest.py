"""Shared fixtures: tiny HF checkpoints written with transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"

# Tiny models: one intra-op thread is much faster than two contending ones on small matmuls.
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory) -> Path:
    """A 4-layer DeepSeek-V3: MLA with q_lora, 8 experts in 2 groups, a dense first layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.5)
    return save_hf(model, tmp_path_factory.mktemp("deepseek"))
