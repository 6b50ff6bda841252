"""DeepSeek-V3 / Kimi-K2 targets compute what HF transformers' DeepseekV3ForCausalLM computes
(fp32, CPU), with MLA's absorbed latent-cache attention agreeing with the expanded form."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import draftsman
from draftsman.models.deepseek import MoE
from draftsman.weights import CheckpointError

TOL = 1e-4
SMALL = dict(
    vocab_size=192, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
    max_position_embeddings=512, bos_token_id=0, eos_token_id=None, num_nextn_predict_layers=0,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
CASES = {
    # DeepSeek-V3 shape: q LoRA, YaRN with mscale != mscale_all_dim (so cos/sin are scaled too),
    # group-limited routing (2 of 4 groups), one dense layer first, one shared expert.
    "v3-qlora-yarn-groups": dict(q_lora_rank=48, rope_parameters=YARN, n_group=4, topk_group=2,
                                 n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
    # DeepSeek-V2-Lite-like: plain q_proj, default rope, non-interleaved rope, biases, two dense
    # layers, two shared experts, unnormalised top-k weights.
    "qproj-default-rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               rope_interleave=False, attention_bias=True, n_group=1, topk_group=1,
                               n_shared_experts=2, first_k_dense_replace=2, norm_topk_prob=False),
}


def randomize(hf: DeepseekV3ForCausalLM) -> None:
    """Weights large enough that attention, rope and routing change the logits (HF's 0.02 init is
    nearly a no-op at this size), random norm weights, and a nonzero routing bias."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight") or "embed_tokens" in name:
                p.normal_(0.0, 1.0)  # confident routing; unit-scale embeddings
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)


def build_hf(case: str) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**SMALL, **CASES[case])).eval()
    randomize(hf)
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, draftsman.load_target(path), path


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    hf = build_hf("v3-qlora-yarn-groups")
    path = tmp_path_factory.mktemp("v3")
    hf.save_pretrained(path)
    return hf, draftsman.load_target(path), path


def ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_matches_hf(hf, model, x: torch.Tensor) -> None:
    assert (hf(x).logits - model(x)).abs().max() < TOL


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through draftsman's cache API: prefill, then one token per step."""
    t = prompt.shape[1]
    cache = model.new_cache(prompt.shape[0], t + n)
    tok = model(prompt, cache=cache)[:, -1:].argmax(-1)
    out = [tok]
    for i in range(n - 1):
        tok = model(tok, cache=cache, positions=torch.full_like(tok, t + i))[:, -1:].argmax(-1)
        out.append(tok)
    return torch.cat(out, 1)


# ---- (a), (e): full forward and aux hidden states ---------------------------------------------
def test_logits_and_aux_states_match_hf(pair):
    hf, model, _ = pair
    attn = model.layers[0].self_attn
    # load_target fuses the projections of x (q or q_a, and kv_a) where neither has a bias: the
    # parity below covers the fused path in one case and the separate one in the other
    assert hasattr(attn, "q_kv_a_proj") == (attn.kv_a_proj_with_mqa.bias is None)
    x = ids(2, 40)
    layers = [0, 1, len(model.layers) - 1]
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
        out = model.run(x, aux_layer_ids=layers)
    assert (ref.logits - out.logits).abs().max() < TOL
    for i, aux in zip(layers, out.aux_hidden, strict=True):
        assert (ref.hidden_states[i] - aux).abs().max() < TOL


def test_routing_matters(v3):
    """The test weights exercise routing: the correction bias and the group limit both change
    which experts are chosen, so a routing bug would show in the logits."""
    _, model, _ = v3
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    h = torch.randn(64, model.config.hidden_size)
    _, chosen = moe.gate(h)
    bias = moe.gate.e_score_correction_bias.clone()
    moe.gate.e_score_correction_bias.zero_()
    _, unbiased = moe.gate(h)
    moe.gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)
    groups = chosen // (model.config.moe.n_routed_experts // model.config.moe.n_group)
    assert all(len(set(row)) <= model.config.moe.topk_group for row in groups.tolist())


# ---- (c): absorbed (cached) attention equals the expanded form ---------------------------------
def test_cached_prefill_chunks_and_decode_match_full_forward(pair):
    _, model, _ = pair
    x = ids(2, 40, seed=2)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(2, 48)
        prefill = model(x[:, :24], cache=cache)  # prefill
        chunk = model(x[:, 24:36], cache=cache, positions=torch.arange(24, 36).expand(2, 12))
        steps = [model(x[:, t : t + 1], cache=cache, positions=torch.full((2, 1), t)) for t in range(36, 40)]
    assert (prefill - full[:, :24]).abs().max() < TOL
    assert (chunk - full[:, 24:36]).abs().max() < TOL
    assert (torch.cat(steps, 1) - full[:, 36:]).abs().max() < TOL


# ---- (b): greedy generation equals HF generate ------------------------------------------------
def test_greedy_generation_matches_hf_generate(pair):
    hf, model, _ = pair
    prompt = ids(1, 10, seed=3)
    with torch.no_grad():
        # An explicit mask: HF would otherwise infer padding from pad_token_id inside the prompt.
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                          do_sample=False, pad_token_id=0)[:, 10:]
    assert ref.shape[1] == 32
    assert torch.equal(greedy(model, prompt, 32), ref)


# ---- (d): tree verify with an arbitrary mask over cache slots ---------------------------------
def test_tree_branch_mask_matches_plain_forward(v3):
    """Four draft tokens at slots P..P+3: a chain t0 -> t1 -> t2 and a branch t3 that is a
    sibling of t1 (sees the prefix and t0 only, at position P+1)."""
    _, model, _ = v3
    prefix, tree = ids(1, 12, seed=4), ids(1, 4, seed=5)
    p = prefix.shape[1]
    mask = torch.zeros(1, 4, p + 4, dtype=torch.bool)
    mask[..., :p] = True
    for row, slots in enumerate([[0], [0, 1], [0, 1, 2], [0, 3]]):
        mask[0, row, [p + s for s in slots]] = True
    with torch.no_grad():
        cache = model.new_cache(1, p + 4)
        model(prefix, cache=cache)
        out = model(tree, cache=cache, positions=torch.tensor([[p, p + 1, p + 2, p + 1]]),
                    cache_index=torch.arange(p, p + 4)[None], attn_mask=mask)
        chain = model(torch.cat([prefix, tree[:, :3]], 1))[:, p:]
        branch = model(torch.cat([prefix, tree[:, [0, 3]]], 1))[:, -1]
    assert (out[:, :3] - chain).abs().max() < TOL
    assert (out[:, 3] - branch).abs().max() < TOL
    assert (out[:, 3] - out[:, 1]).abs().max() > 1e-2  # the branch really differs from its sibling


# ---- (f): checkpoint formats ------------------------------------------------------------------
def per_expert_state(hf) -> dict[str, torch.Tensor]:
    """HF's in-memory state dict with fused experts split into DeepSeek's per-expert names."""
    out = {}
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{stem}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("mlp.experts.down_proj"):
            stem = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{stem}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def write_sharded(tensors: dict[str, torch.Tensor], path: Path, config: dict, shards: int = 2) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_save_pretrained_writes_per_expert_tensors(v3):
    """transformers 5 keeps experts fused in memory but save_pretrained writes DeepSeek's layout."""
    _, _, path = v3
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


def test_per_expert_sharded_checkpoint_loads(v3, tmp_path):
    hf, _, path = v3
    out = write_sharded(per_expert_state(hf), tmp_path / "sharded", hf_config(path))
    assert_matches_hf(hf, draftsman.load_target(out), ids(2, 24))


def test_fused_expert_checkpoint_is_a_clear_error(v3, tmp_path):
    hf, _, _ = v3
    hf.save_pretrained(tmp_path, save_original_format=False)
    with pytest.raises(CheckpointError, match="fused expert tensors"):
        draftsman.load_target(tmp_path)


def test_missing_expert_slice_is_reported(v3, tmp_path):
    hf, _, path = v3
    state = per_expert_state(hf)
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    out = write_sharded(state, tmp_path / "ckpt", hf_config(path), shards=1)
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.up_proj\[5\]"):
        draftsman.load_target(out)


# ---- (g): Kimi-K2 and Kimi-K2.5 --------------------------------------------------------------
def test_kimi_k2_config_loads(v3, tmp_path):
    """Kimi-K2's published config: model_type kimi_k2, legacy rope_theta + rope_scaling."""
    hf, _, path = v3
    shutil.copy(path / "model.safetensors", tmp_path)
    cfg = hf_config(path)
    rope = cfg.pop("rope_parameters")
    cfg |= {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "rope_theta": rope.pop("rope_theta"), "rope_scaling": {**rope, "type": rope.pop("rope_type")}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = draftsman.load_target(tmp_path)
    assert model.config.model_type == "kimi_k2" and model.config.rope.type == "yarn"
    assert_matches_hf(hf, model, ids(2, 24))


def test_kimi_k25_wrapped_checkpoint_loads(v3, tmp_path):
    hf, _, path = v3
    tensors = {f"language_model.{n}": t for n, t in per_expert_state(hf).items()}
    tensors["vision_tower.x.weight"] = torch.zeros(3, 3)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": hf_config(path), "vision_config": {"hidden_size": 3}}
    model = draftsman.load_target(write_sharded(tensors, tmp_path / "k25", config))
    assert model.config.weight_prefix == "language_model."
    assert_matches_hf(hf, model, ids(2, 24))


# ---- (h): DeepSeek-V3's MTP layer is skipped --------------------------------------------------
def test_mtp_layer_tensors_are_skipped(v3, tmp_path):
    hf, _, path = v3
    n, h = SMALL["num_hidden_layers"], SMALL["hidden_size"]
    tensors = per_expert_state(hf)
    tensors |= {f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h),
                f"model.layers.{n}.enorm.weight": torch.ones(h),
                f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(32, h),
                f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.randn(4, 4)}
    config = hf_config(path) | {"num_nextn_predict_layers": 1}
    model = draftsman.load_target(write_sharded(tensors, tmp_path / "mtp", config))
    assert model.config.num_nextn_predict_layers == 1 and len(model.layers) == n
    assert_matches_hf(hf, model, ids(2, 24))


def test_dense_experts_equal_grouped():
    """The sync-free all-experts path (few experts) computes what the routed loop computes."""
    from draftsman.config import MoEConfig
    from draftsman.models.deepseek import Experts

    torch.manual_seed(0)
    moe = MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    experts = Experts(16, moe)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(37, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(37)])
    weights = torch.rand(37, 2)
    dense, grouped = experts.dense(x, weights, ids), experts.grouped(x, weights, ids)
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-6)
    assert experts(x, weights, ids).equal(dense)  # 4 experts <= 2 * top-2: the dense path runs
