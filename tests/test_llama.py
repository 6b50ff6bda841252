"""Llama-family targets compute what HF transformers computes (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy_cached, hf_greedy
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import draftsman

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CASES = {
    "llama-llama3": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-tied-yarn": (LlamaForCausalLM, LlamaConfig(**SMALL, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})),
    "llama-linear-bias-mha": (LlamaForCausalLM, LlamaConfig(**(SMALL | {"num_key_value_heads": 4}),
        attention_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": (MistralForCausalLM, MistralConfig(**SMALL, sliding_window=None)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=32)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cls, cfg = CASES[request.param]
    torch.manual_seed(0)
    hf = cls(cfg).eval()
    with torch.no_grad():  # random biases/norm weights so those code paths matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, draftsman.load_target(path)


def test_logits_and_aux_states_match_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        layers = [0, 2, len(ours.layers) - 1]
        out = ours.run(ids, aux_layer_ids=layers)
    assert (ref.logits - out.logits).abs().max() < 1e-4
    for i, aux in zip(layers, out.aux_hidden, strict=True):
        assert torch.allclose(aux, ref.hidden_states[i], atol=1e-5), f"aux layer {i}"


def test_greedy_generation_matches_hf(pair):
    hf, ours = pair
    prompt = torch.randint(0, 256, (1, 12))
    assert greedy_cached(ours, prompt, 32).tolist() == hf_greedy(hf, prompt, 32).tolist()


def test_cached_decode_equals_full_forward(pair):
    _, ours = pair
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(2, 64)
        parts = [ours(ids[:, :25], cache=cache)]
        for t in range(25, 40):
            parts.append(ours(ids[:, t:t + 1], cache=cache, positions=torch.full((2, 1), t)))
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-4


def test_tree_mask_over_cache_equals_branch_forward(pair):
    """Four tokens written after the prefix; token 3 sees only the prefix and token 0."""
    _, ours = pair
    prefix, extra = torch.randint(0, 256, (1, 10)), torch.randint(0, 256, (1, 4))
    with torch.no_grad():
        cache = ours.new_cache(1, 32)
        ours(prefix, cache=cache)
        mask = torch.zeros(1, 4, 14, dtype=torch.bool)
        mask[:, :, :10] = True
        mask[0, torch.arange(4), 10 + torch.arange(4)] = True  # each sees itself
        mask[0, 3, 10] = True  # token 3 is a child of token 0
        positions = torch.tensor([[10, 11, 11, 11]])
        tree = ours(extra, cache=cache, cache_index=torch.arange(10, 14)[None], positions=positions,
                    attn_mask=mask)
        branch = ours(torch.cat([prefix, extra[:, [0, 3]]], 1))
    assert (tree[0, 3] - branch[0, -1]).abs().max() < 1e-4
    assert (tree[0, 0] - branch[0, -2]).abs().max() < 1e-4


def test_aux_layer_id_range(pair):
    _, ours = pair
    n = len(ours.layers)
    out = ours.run(torch.randint(0, 256, (1, 5)), aux_layer_ids=[n])
    assert out.aux_hidden[0].shape == (1, 5, 64)  # the pre-norm output of the last layer
    with pytest.raises(ValueError, match="out of range"):
        ours.run(torch.randint(0, 256, (1, 5)), aux_layer_ids=[n + 1])


def test_fused_projections_compute_the_same_and_keep_names(tiny_llama_dir):
    plain = draftsman.load_target(tiny_llama_dir, fuse=False)
    fused = draftsman.load_target(tiny_llama_dir)
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and hasattr(mlp, "gate_up_proj")
    assert not hasattr(plain.layers[0].self_attn, "qkv_proj")
    # the originals are views of the fused weights: one copy in memory, same names and values
    assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
    assert fused.state_dict().keys() == plain.state_dict().keys()
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    ids = torch.randint(0, fused.config.vocab_size, (2, 9))
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_decode_linear_swaps_class_only_and_off_gpu_is_linear(tiny_llama_dir):
    """use_gemv / use_cpu_packing change classes, not parameters; back on nn.Linear a CPU model
    computes F.linear, within fp32 rounding of the packed oneDNN products (tests/test_cpu_packing.py).
    The Triton path itself: tests/test_kernels.py (-m gpu)."""
    from draftsman.models.layers import CPU_PACK, DecodeLinear, use_cpu_packing, use_gemv

    model = draftsman.load_target(tiny_llama_dir)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    before = model(ids)
    o = model.layers[0].self_attn.o_proj
    assert type(o) is (DecodeLinear if CPU_PACK else torch.nn.Linear)
    use_gemv(model, on=False)
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-5)
    use_cpu_packing(model)
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    use_gemv(model, on=False)
    assert type(o) is torch.nn.Linear and type(model.layers[0].self_attn.qkv_proj) is torch.nn.Linear
