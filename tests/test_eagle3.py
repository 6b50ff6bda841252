"""EAGLE-3 drafter: checkpoint format (hand-written official layout), conventions, validation,
cache equivalence and an independent reference implementation of the layer math."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import draftsman
from draftsman.config import ConfigError, UnsupportedModelError, parse_drafter_config
from draftsman.models.eagle3 import init_drafter, load_drafter, save_drafter
from draftsman.weights import CheckpointError

V, HT, LAYERS = 128, 32, 8  # target vocab, hidden, layers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=HT, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("eagle3_target")
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return draftsman.load_target(target_dir)


def spec_config(**over) -> dict:
    """A SpecForge-style drafter config.json (the keys SpecForge's configs/*.json use)."""
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama", "hidden_act": "silu",
        "hidden_size": HT, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32", "vocab_size": V, "draft_vocab_size": 48, "target_hidden_size": HT,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
    }
    for k, v in over.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


def official_tensors(raw: dict, seed: int = 1, draft_ids: torch.Tensor | None = None) -> dict:
    """Random tensors under the exact names of published EAGLE-3 checkpoints."""
    g = torch.Generator().manual_seed(seed)
    h, ht = raw["hidden_size"], raw.get("target_hidden_size", raw["hidden_size"])
    nh, nkv, d, inter = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"], raw["intermediate_size"]
    vocab = raw["vocab_size"]
    vd = raw.get("draft_vocab_size") or vocab

    def r(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "fc.weight": r(h, 3 * ht),
        "midlayer.input_layernorm.weight": 1 + r(h),
        "midlayer.hidden_norm.weight": 1 + r(h),
        "midlayer.post_attention_layernorm.weight": 1 + r(h),
        "midlayer.self_attn.q_proj.weight": r(nh * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(nkv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, nh * d),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": 1 + r(h),
        "lm_head.weight": r(vd, h),
    }
    if draft_ids is None:
        draft_ids = torch.randperm(vocab, generator=g)[:vd].sort().values
    t["d2t"] = draft_ids - torch.arange(vd)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    t["t2d"] = t2d
    return t


def write_ckpt(path: Path, raw: dict, tensors: dict, fmt: str = "safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    else:
        torch.save(dict(tensors), path / "pytorch_model.bin")
    return path


def state(drafter) -> dict:
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def assert_tensors_equal(drafter, tensors: dict) -> None:
    sd = drafter.state_dict()
    for name, t in tensors.items():
        if name in ("embed_tokens.weight", "model.embed_tokens.weight") and name not in sd:
            continue
        assert name in sd, name
        assert sd[name].dtype == t.dtype or t.dtype not in (torch.int64, torch.bool), name
        assert torch.equal(sd[name], t), name


# ---- (a) hand-written official checkpoint -------------------------------------------------------
def test_load_handwritten_safetensors(tmp_path, target):
    raw = spec_config()
    tensors = official_tensors(raw)
    d = load_drafter(write_ckpt(tmp_path / "d", raw, tensors), target=target)
    assert set(d.state_dict()) == set(tensors)  # exactly the official names, nothing else
    assert_tensors_equal(d, tensors)
    cfg = d.config
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size, cfg.head_dim) == (V, 48, HT, 8)
    # SpecForge "output of layer i" ids [1, 3, 4] -> residual entering layers 2, 4, 5 (SGLang's +1)
    assert cfg.raw_aux_layer_ids == (1, 3, 4)
    assert cfg.layer_id_convention == "output"
    assert d.aux_layer_ids == cfg.aux_layer_ids == (2, 4, 5)
    assert "eagle_config.eagle_aux_hidden_state_layer_ids" in d.layer_ids_source
    assert "+1" in d.layer_ids_source
    # the vocabulary map: target_id = draft_id + d2t[draft_id]
    ids = torch.arange(48)
    expected = ids + tensors["d2t"]
    assert torch.equal(d.draft_to_target(ids), expected)
    assert torch.equal(d.target_logits_mask, tensors["t2d"])
    full = d.to_target_logits(torch.randn(2, 48))
    assert torch.isinf(full[:, ~tensors["t2d"]]).all() and torch.isfinite(full[:, tensors["t2d"]]).all()
    # same checkpoint read with vLLM's convention: ids taken as given
    d2 = load_drafter(tmp_path / "d", target=target, layer_id_convention="vllm")
    assert d2.aux_layer_ids == (1, 3, 4) and d2.config.layer_id_convention == "input"


def test_aux_id_rules():
    src = "x/config.json"
    top = parse_drafter_config(spec_config(eagle_config={}, eagle_aux_hidden_state_layer_ids=[2, 4, 5]), src)
    assert top.aux_layer_ids == (2, 4, 5) and top.layer_id_convention == "input"  # vLLM key
    top_sg = parse_drafter_config(
        spec_config(eagle_config={}, eagle_aux_hidden_state_layer_ids=[1, 3, 4]), src, layer_id_convention="sglang"
    )
    assert top_sg.aux_layer_ids == (2, 4, 5)
    none = parse_drafter_config(spec_config(eagle_config=None), src)
    assert none.aux_layer_ids is None and none.layer_ids_source.startswith("default")
    block = parse_drafter_config(spec_config(draftsman={"aux_layer_ids": [2, 4, 5], "layer_id_convention": "input"}), src)
    assert block.aux_layer_ids == (2, 4, 5) and "draftsman" in block.layer_ids_source
    # the block wins over a caller's convention (it is unambiguous)
    assert parse_drafter_config(spec_config(draftsman={"aux_layer_ids": [2, 4, 5]}), src, "vllm").aux_layer_ids == (2, 4, 5)
    with pytest.raises(ConfigError, match=r"x/config.json: draftsman.aux_layer_ids=\[2, 4, 6\].*disagrees"):
        parse_drafter_config(spec_config(draftsman={"aux_layer_ids": [2, 4, 6]}), src)
    both = parse_drafter_config(spec_config(eagle_aux_hidden_state_layer_ids=[1, 3, 4]), src)
    assert both.aux_layer_ids == (2, 4, 5) and "vLLM would capture the input of layers [1, 3, 4]" in both.layer_ids_source
    with pytest.raises(ConfigError, match=r"x/config.json: field 'eagle_config.eagle_aux_hidden_state_layer_ids' must list exactly 3"):
        parse_drafter_config(spec_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), src)
    with pytest.raises(ConfigError, match="layer_id_convention='bogus'"):
        parse_drafter_config(spec_config(), src, layer_id_convention="bogus")


def test_config_errors_name_file_and_field():
    src = "ckpt/config.json"
    with pytest.raises(UnsupportedModelError, match=r"ckpt/config.json: field 'architectures'.*EAGLE-1/2"):
        parse_drafter_config(spec_config(architectures=["LlamaForCausalLMEagle"]), src)
    with pytest.raises(UnsupportedModelError, match="not an EAGLE-3 drafter"):
        parse_drafter_config(spec_config(architectures=["LlamaForCausalLM"]), src)
    with pytest.raises(ConfigError, match=r"ckpt/config.json: missing required field 'hidden_size'"):
        parse_drafter_config(spec_config(hidden_size=None), src)
    with pytest.raises(ConfigError, match=r"field 'fc_norm'"):
        parse_drafter_config(spec_config(fc_norm=True), src)
    with pytest.raises(ConfigError, match=r"field 'num_hidden_layers'=2"):
        parse_drafter_config(spec_config(num_hidden_layers=2), src)
    assert parse_drafter_config(spec_config(architectures=["Eagle3LlamaForCausalLM"]), src).architecture == "Eagle3LlamaForCausalLM"
    # RoPE in either spelling
    a = parse_drafter_config(spec_config(rope_theta=None, rope_scaling=None,
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}), src)
    b = parse_drafter_config(spec_config(rope_theta=5e5), src)
    assert a.rope == b.rope and a.rope.theta == 5e5


# ---- (b) pytorch_model.bin ----------------------------------------------------------------------
def test_load_pytorch_bin(tmp_path, target):
    raw = spec_config()
    tensors = official_tensors(raw, seed=2)
    d = load_drafter(write_ckpt(tmp_path / "bin", raw, tensors, fmt="bin"), target=target)
    assert_tensors_equal(d, tensors)
    assert d.aux_layer_ids == (2, 4, 5)


# ---- (c) round trip -----------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path, target):
    raw = spec_config()
    d = load_drafter(write_ckpt(tmp_path / "a", raw, official_tensors(raw, seed=3)), target=target)
    out = save_drafter(d, tmp_path / "b")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # what vLLM reads (input of layer i)
    assert cfg["draftsman"] == {"aux_layer_ids": [2, 4, 5], "layer_id_convention": "input"}
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None and cfg["torch_dtype"] == "float32"
    assert cfg["draft_vocab_size"] == 48 and cfg["target_hidden_size"] == HT and cfg["vocab_size"] == V
    assert not list(out.glob("*.tmp"))
    e = load_drafter(out, target=target)
    assert e.aux_layer_ids == d.aux_layer_ids and "draftsman" in e.layer_ids_source
    assert state(e).keys() == state(d).keys()
    for k, v in state(d).items():
        assert torch.equal(state(e)[k], v) and state(e)[k].dtype == v.dtype, k
    # without the draftsman block, the same file still means the same layers (eagle_config, +1)
    del cfg["draftsman"]
    assert parse_drafter_config(cfg).aux_layer_ids == (2, 4, 5)
    ids = torch.randint(0, V, (2, 7))
    hidden = torch.randn(2, 7, HT)
    with torch.no_grad():
        la, ha = d(ids, hidden)
        lb, hb = e(ids, hidden)
    assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_round_trip_default_ids_and_init(tmp_path, target):
    d = init_drafter(target, seed=0)
    assert d.aux_layer_ids == (2, LAYERS // 2, LAYERS - 3)
    assert "default" in d.layer_ids_source and "8-layer" in d.layer_ids_source
    e = load_drafter(save_drafter(d, tmp_path / "x"), target=target)
    assert e.aux_layer_ids == (2, 4, 5) and e.config.full_vocab
    for k, v in state(d).items():
        assert torch.equal(state(e)[k], v), k
    # nothing of the target is registered or saved
    assert "embed_tokens.weight" not in d.state_dict()
    assert all(m is not target for m in d.modules())


# ---- (d) full vocabulary when draft_vocab_size is absent ---------------------------------------
def test_full_vocab_when_draft_vocab_absent(tmp_path, target):
    raw = spec_config(draft_vocab_size=None)
    tensors = official_tensors(raw, seed=4)
    del tensors["d2t"], tensors["t2d"]  # SafeAILab/EAGLE drops them for a full vocabulary
    d = load_drafter(write_ckpt(tmp_path / "f", raw, tensors), target=target)
    assert d.config.draft_vocab_size == V and d.config.full_vocab
    assert torch.equal(d.d2t, torch.zeros(V, dtype=torch.int64)) and bool(d.t2d.all())
    assert any("'d2t' absent" in n for n in d.notes)
    assert torch.equal(d.draft_to_target(torch.arange(V)), torch.arange(V))
    # a reduced vocabulary without its map is an error naming the tensor
    raw = spec_config()
    tensors = official_tensors(raw, seed=4)
    del tensors["d2t"], tensors["t2d"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'd2t'.*draft_vocab_size=48 != vocab_size=128"):
        load_drafter(write_ckpt(tmp_path / "g", raw, tensors), target=target)


def test_lm_head_from_target_when_absent(tmp_path, target):
    raw = spec_config(draft_vocab_size=None)
    tensors = official_tensors(raw, seed=5)
    del tensors["lm_head.weight"]
    path = write_ckpt(tmp_path / "h", raw, tensors)
    d = load_drafter(path, target=target)  # SGLang's behaviour: the target's lm_head
    assert torch.equal(d.lm_head.weight, target.lm_head.weight)
    assert any("lm_head" in n for n in d.notes)
    with pytest.raises(CheckpointError, match=r"missing tensors in drafter checkpoint: \['lm_head.weight'\]"):
        load_drafter(path)


# ---- (e) mismatches -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("over", "edit", "message"),
    [
        ({"target_hidden_size": 16}, None, r"drafter target_hidden_size=16 but target hidden_size=32"),
        ({"vocab_size": 100}, None, r"drafter vocab_size=100 but target vocab_size=128"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}}, None,
         r"aux layer ids \[2, 4, 9\].*include \[9\], out of range for a 8-layer target \(valid: 0..8"),
        ({}, "d2t_out", r"d2t maps 1 draft ids outside the target vocabulary 0..127"),
        ({}, "d2t_dup", r"d2t has duplicates.*same target id"),
        ({}, "t2d", r"t2d is inconsistent with d2t"),
    ],
)
def test_mismatch_errors(tmp_path, target, over, edit, message):
    raw = spec_config(**over)
    tensors = official_tensors(raw, seed=6)
    if edit == "d2t_out":
        tensors["d2t"][-1] = 10_000
    elif edit == "d2t_dup":
        tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft id 1 -> same target id as draft id 0
    elif edit == "t2d":
        tensors["t2d"][~tensors["t2d"].clone()] = True
    path = write_ckpt(tmp_path / "m", raw, tensors)
    with pytest.raises(ValueError, match=message):
        load_drafter(path, target=target)


def test_shape_error_names_tensor(tmp_path):
    raw = spec_config()
    tensors = official_tensors(raw)
    tensors["midlayer.self_attn.q_proj.weight"] = torch.zeros(32, HT)  # 1H wide instead of 2H
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'midlayer.self_attn.q_proj.weight' has shape \[32, 32\]"):
        load_drafter(write_ckpt(tmp_path / "s", raw, tensors))


# ---- (f) cache equivalence and an independent reference -----------------------------------------
def test_cached_steps_equal_full_forward(target):
    d = init_drafter(target, seed=1, draft_vocab_size=40, draft_token_ids=torch.arange(0, 120, 3)[:40])
    b, t = 2, 7
    ids = torch.randint(0, V, (b, t))
    hidden = torch.randn(b, t, HT)
    with torch.no_grad():
        full_logits, full_hidden = d(ids, hidden, torch.arange(t).expand(b, t))
        cache = d.new_cache(b, 16)
        assert cache.num_layers == 1 and tuple(cache.buffers["k"].shape) == (1, b, 16, 2, 8)
        chunks = [(0, 3), (3, 4), (4, 5), (5, 7)]
        logits, hid = [], []
        for s, e in chunks:
            pos = torch.arange(s, e).expand(b, e - s)
            lo, hi = d(ids[:, s:e], hidden[:, s:e], pos, cache=cache)
            logits.append(lo)
            hid.append(hi)
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(hid, 1), full_hidden, atol=1e-5, rtol=1e-5)


def test_tree_mask_over_cache_equals_separate_branches(target):
    """Two sibling drafts at the same position, in slots 4 and 5, each seeing the prefix and itself."""
    d = init_drafter(target, seed=3)
    prefix, hidden = torch.randint(0, V, (1, 4)), torch.randn(1, 6, HT)
    sib = torch.randint(0, V, (1, 2))
    with torch.no_grad():
        cache = d.new_cache(1, 8)
        d(prefix, hidden[:, :4], torch.arange(4)[None], cache=cache)
        mask = torch.zeros(1, 2, 6, dtype=torch.bool)
        mask[:, :, :4] = True
        mask[0, 0, 4] = mask[0, 1, 5] = True
        tree, _ = d(sib, hidden[:, 4:], torch.tensor([[4, 4]]), cache=cache,
                    cache_index=torch.tensor([[4, 5]]), attn_mask=mask)
        for j in range(2):
            ids = torch.cat([prefix, sib[:, j:j + 1]], 1)
            h = torch.cat([hidden[:, :4], hidden[:, 4 + j:5 + j]], 1)
            alone, _ = d(ids, h)
            torch.testing.assert_close(tree[:, j], alone[:, -1], atol=1e-5, rtol=1e-5)


def reference_forward(d, target, ids, hidden, positions):
    """The drafter layer written out literally: plain loops, no shared helpers."""
    cfg = d.config
    p = {k: v.detach().double() for k, v in d.state_dict().items() if v.is_floating_point()}
    emb_table = target.embed_tokens.weight.detach().double()
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean() + eps))

    def rope(vec, pos):  # vec [hd]: pair (j, j + hd/2) rotated by pos * theta^(-2j/hd)
        out = vec.clone()
        for j in range(hd // 2):
            ang = pos * cfg.rope.theta ** (-2 * j / hd)
            a, c = vec[j], vec[j + hd // 2]
            out[j] = a * math.cos(ang) - c * math.sin(ang)
            out[j + hd // 2] = c * math.cos(ang) + a * math.sin(ang)
        return out

    B, T = ids.shape
    logits = torch.zeros(B, T, cfg.draft_vocab_size, dtype=torch.float64)
    outs = torch.zeros(B, T, cfg.hidden_size, dtype=torch.float64)
    for b in range(B):
        qs, ks, vs = [], [], []
        for t in range(T):
            h = hidden[b, t].double()
            x = torch.cat([rms(emb_table[ids[b, t]], p["midlayer.input_layernorm.weight"]),
                           rms(h, p["midlayer.hidden_norm.weight"])])
            q = p["midlayer.self_attn.q_proj.weight"] @ x
            k = p["midlayer.self_attn.k_proj.weight"] @ x
            v = p["midlayer.self_attn.v_proj.weight"] @ x
            pos = float(positions[b, t])
            qs.append([rope(q[i * hd:(i + 1) * hd], pos) for i in range(nh)])
            ks.append([rope(k[i * hd:(i + 1) * hd], pos) for i in range(nkv)])
            vs.append([v[i * hd:(i + 1) * hd] for i in range(nkv)])
        for t in range(T):
            h = hidden[b, t].double()
            heads = []
            for i in range(nh):
                g = i // (nh // nkv)
                scores = [float(qs[t][i] @ ks[s][g]) / math.sqrt(hd) for s in range(t + 1)]
                m = max(scores)
                w = [math.exp(sc - m) for sc in scores]
                z = sum(w)
                heads.append(sum((w[s] / z) * vs[s][g] for s in range(t + 1)))
            a = p["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
            h1 = h + a
            n = rms(h1, p["midlayer.post_attention_layernorm.weight"])
            gate = p["midlayer.mlp.gate_proj.weight"] @ n
            up = p["midlayer.mlp.up_proj.weight"] @ n
            h2 = h1 + p["midlayer.mlp.down_proj.weight"] @ (gate / (1 + torch.exp(-gate)) * up)
            outs[b, t] = h2
            logits[b, t] = p["lm_head.weight"] @ rms(h2, p["norm.weight"])
    return logits, outs


def test_reference_layer_math(tmp_path, target):
    raw = spec_config()
    d = load_drafter(write_ckpt(tmp_path / "r", raw, official_tensors(raw, seed=7)), target=target)
    b, t = 2, 5
    ids = torch.randint(0, V, (b, t))
    hidden = torch.randn(b, t, HT)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    with torch.no_grad():
        logits, out = d(ids, hidden, positions)
    ref_logits, ref_out = reference_forward(d, target, ids, hidden, positions)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)


def test_project_and_target_pipeline(tmp_path, target):
    d = init_drafter(target, seed=2)
    ids = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        out = target.run(ids, aux_layer_ids=d.aux_layer_ids)
        h0 = d.project(out.aux_hidden)
        assert h0.shape == (1, 6, HT)
        torch.testing.assert_close(h0, d.fc(torch.cat(out.aux_hidden, -1)))
        logits, h1 = d(ids[:, 1:], h0[:, :-1])
    assert logits.shape == (1, 5, V) and h1.shape == (1, 5, HT)
    with pytest.raises(ValueError, match="fc expects 3 x target_hidden_size = 96"):
        d.project(out.aux_hidden[:2])
    unbound = load_drafter(save_drafter(d, tmp_path / "unbound"))
    with pytest.raises(RuntimeError, match="bind_target"):
        unbound(ids, torch.zeros(1, 6, HT))


# ---- (g) embed_tokens in the checkpoint ---------------------------------------------------------
def test_embed_tokens_skipped_and_noted(tmp_path, target):
    raw = spec_config()
    tensors = official_tensors(raw, seed=8)
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    d = load_drafter(write_ckpt(tmp_path / "e1", raw, tensors), target=target)
    assert "embed_tokens.weight" not in d.state_dict()
    assert any("skipped 'embed_tokens.weight'" in n and "identical" in n for n in d.notes)
    tensors.pop("embed_tokens.weight")
    tensors["model.embed_tokens.weight"] = torch.randn(V, HT)
    d = load_drafter(write_ckpt(tmp_path / "e2", raw, tensors), target=target)
    assert any("skipped 'model.embed_tokens.weight'" in n and "differs" in n for n in d.notes)
    save_drafter(d, tmp_path / "e3")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "e3" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors) - {"model.embed_tokens.weight"}  # never written back


def test_narrow_drafter_needs_own_embedding(tmp_path, target):
    """hidden_size != target_hidden_size: SGLang and SafeAILab/EAGLE use the checkpoint's embedding."""
    raw = spec_config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
    tensors = official_tensors(raw, seed=9)
    with pytest.raises(CheckpointError, match=r"missing tensor 'embed_tokens.weight'.*hidden_size=16"):
        load_drafter(write_ckpt(tmp_path / "n1", raw, tensors), target=target)
    tensors["embed_tokens.weight"] = torch.randn(V, 16)
    d = load_drafter(write_ckpt(tmp_path / "n2", raw, tensors), target=target)
    assert d.has_own_embedding and torch.equal(d.embed_tokens.weight, tensors["embed_tokens.weight"])
    with torch.no_grad():
        logits, h = d(torch.randint(0, V, (1, 4)), d.project(torch.randn(1, 4, 3 * HT)))
    assert logits.shape == (1, 4, 48) and h.shape == (1, 4, 16)
    e = load_drafter(save_drafter(d, tmp_path / "n3"), target=target)
    assert torch.equal(e.embed_tokens.weight, d.embed_tokens.weight)


def test_speculators_layer_names_accepted(tmp_path, target):
    raw = spec_config()
    tensors = official_tensors(raw, seed=10)
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    d = load_drafter(write_ckpt(tmp_path / "l", raw, renamed), target=target)
    assert_tensors_equal(d, tensors)


def test_inference_drafter_is_fused_frozen_and_computes_the_same(tmp_path):
    import draftsman
    from draftsman.models.eagle3 import load_drafter

    target_dir, drafter_dir = draftsman.reference_pair()
    target = draftsman.load_target(target_dir)
    plain = load_drafter(drafter_dir, target=target)
    fused = load_drafter(drafter_dir, target=target, inference=True)
    attn = fused.midlayer.self_attn
    assert hasattr(attn, "qkv_proj") and hasattr(fused.midlayer.mlp, "gate_up_proj")
    assert not any(p.requires_grad for p in fused.parameters())
    assert fused.state_dict().keys() == plain.state_dict().keys()
    # a trainable drafter is never fused: gradients must reach its parameters
    assert not hasattr(plain.midlayer.self_attn, "qkv_proj")
    plain.midlayer.self_attn.fuse()
    assert not hasattr(plain.midlayer.self_attn, "qkv_proj")
    ids = torch.randint(0, 8000, (2, 7))
    hidden = torch.randn(2, 7, 256)
    with torch.no_grad():
        a, ha = fused(ids, hidden)
        b, hb = plain(ids, hidden)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ha, hb, rtol=1e-5, atol=1e-5)
