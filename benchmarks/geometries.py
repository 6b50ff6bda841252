"""Model geometries the GPU benchmarks build with random weights (HF config.json dicts)."""

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}

# moonshotai/Moonlight-16B-A3B: DeepseekV3 architecture, MLA without q_lora, 64 routed experts
# (top-6) + 2 shared, first layer dense. A token reads 5.16 GB of it (routed experts it uses only).
MOONLIGHT_16B_A3B = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
    "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585, "torch_dtype": "bfloat16",
}
