"""config.json parsing: both RoPE spellings, families, clear errors."""

from __future__ import annotations

import json

import pytest

import draftsman
from draftsman.config import ConfigError, UnsupportedModelError, parse_target_config

BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def test_both_rope_spellings_parse_the_same():
    legacy = parse_target_config(BASE | {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    v5 = parse_target_config(BASE | {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert legacy.rope == v5.rope
    assert legacy.rope.type == "llama3" and legacy.rope.theta == 500000.0
    # the old `type` key (DeepSeek-V3 / Kimi-K2 configs) is read too
    ds = parse_target_config(BASE | {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0,
                                                      "mscale_all_dim": 1.0, "beta_fast": 32,
                                                      "original_max_position_embeddings": 4096}})
    assert ds.rope.type == "yarn" and ds.rope.mscale_all_dim == 1.0 and ds.rope.factor == 40.0


def test_families_and_defaults():
    cfg = parse_target_config(BASE)
    assert cfg.family == "llama" and cfg.head_dim == 16 and cfg.default_aux_layer_ids() == (2, 2, 1)
    q2 = parse_target_config(BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert q2.attention_bias and not q2.qk_norm
    q3 = parse_target_config(BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    assert q3.qk_norm
    kimi = parse_target_config(BASE | {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_group": 2, "topk_group": 1, "eos_token_id": [5, 6]})
    assert kimi.family == "deepseek" and kimi.model_type == "kimi_k2"
    assert kimi.mla.q_lora_rank is None and kimi.moe.n_group == 2 and kimi.eos_token_ids == (5, 6)


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError) as e:
        parse_target_config(BASE | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "gpt2" in msg
    assert "LlamaForCausalLM" in msg and "DeepseekV3ForCausalLM" in msg


def test_missing_field_and_bad_rope_are_named():
    bad = dict(BASE)
    del bad["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_target_config(bad)
    with pytest.raises(ConfigError, match="dynamic"):
        parse_target_config(BASE | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_unreadable_config_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json"):
        draftsman.load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"architectures": ["BertModel"],
                                                             "model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="BertModel"):
        draftsman.load_target(tmp_path)
