"""INT4 compressed-tensors pack-quantized targets: tiny DeepSeek-V3 checkpoints written here in
the exact layout Kimi-K2-Thinking / Kimi-K2.5 ship (weight_packed int32 / weight_scale bf16 /
weight_shape, quantization_config with its ignore list) load packed, dequantize per layer, and
give the same logits as a dequantized bf16 copy; the packing matches compressed-tensors'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import greedy_cached
from safetensors import safe_open
from safetensors.torch import save_file

import draftsman
from draftsman.config import ConfigError
from draftsman.quant import (
    PackedInt4Linear,
    dequantize,
    is_ignored,
    pack_int4,
    parse_quant_config,
    quantize_int4,
    unpack_int4,
)
from draftsman.weights import CheckpointError

# Kimi-K2-Thinking's quantization_config.ignore (config.json).
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
# Kimi-K2.5 (text_config.quantization_config): the same in regex form plus the vision modules.
KIMI25_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                 "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"]
GROUP = 32


def quant_config(ignore: list[str]) -> dict:
    return {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP,
                        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                        "symmetric": True, "type": "int"}}},
        "format": "pack-quantized", "ignore": ignore, "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


def linear_weight(name: str) -> bool:
    """A Linear layer's weight in a DeepSeek-V3 checkpoint (not embedding, norms or the router)."""
    return name.endswith(".weight") and "norm" not in name and "embed_tokens" not in name \
        and not name.endswith("mlp.gate.weight")


def write_packed(src: Path, out: Path, ignore: list[str], wrap: bool = False,
                 deq_dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """(packed checkpoint, dequantized copy in `deq_dtype`) of the HF checkpoint in `src`. With
    `wrap`, the Kimi-K2.5 layout: text model under language_model., quantization_config in
    text_config."""
    prefix = "language_model." if wrap else ""
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        state = {n: f.get_tensor(n).to(torch.bfloat16) for n in f.keys()}  # noqa: SIM118
    packed, deq = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if linear_weight(name) and not _ignored(prefix + module, ignore):
            q, scale = quantize_int4(t, GROUP)
            packed[prefix + module + ".weight_packed"] = pack_int4(q)
            packed[prefix + module + ".weight_scale"] = scale
            packed[prefix + module + ".weight_shape"] = torch.tensor(list(t.shape))
            deq[prefix + name] = (q.float() * scale.float().repeat_interleave(GROUP, -1)).to(deq_dtype)
        else:
            packed[prefix + name] = deq[prefix + name] = t
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    qcfg = quant_config(ignore)
    if wrap:
        cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": cfg | {"quantization_config": qcfg}, "vision_config": {"hidden_size": 3}}
        plain = json.loads(json.dumps(cfg))
        del plain["text_config"]["quantization_config"]
    else:
        plain = dict(cfg)
        cfg = cfg | {"quantization_config": qcfg}
    for d, tensors, c in ((out / "packed", packed, cfg), (out / "deq", deq, plain)):
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(c))
    return out / "packed", out / "deq"


def _ignored(name: str, ignore: list[str]) -> bool:
    import re

    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


@pytest.fixture(scope="module")
def kimi(tiny_deepseek_dir, tmp_path_factory) -> tuple[Path, Path]:
    return write_packed(tiny_deepseek_dir, tmp_path_factory.mktemp("kimi"), KIMI_IGNORE)


@pytest.fixture(scope="module")
def all_linear(tiny_deepseek_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Everything but lm_head packed: attention (incl. kv_b_proj, read directly by MLA's absorbed
    decode), dense MLP, shared experts and routed experts."""
    return write_packed(tiny_deepseek_dir, tmp_path_factory.mktemp("all"), ["lm_head"], deq_dtype=torch.float32)


# ---- format ----------------------------------------------------------------------------------
def test_packing_matches_compressed_tensors():
    q = torch.randint(-8, 8, (6, 40), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, 5)
    assert torch.equal(unpack_int4(packed, 40), q)
    # value i at bits 4i (low nibble first), stored as q + 8
    assert int(pack_int4(torch.tensor([[1, -8, 0, 0, 0, 0, 0, 7]], dtype=torch.int8))[0, 0]) \
        == (9 | 0 << 4 | 8 << 8 | 8 << 12 | 8 << 16 | 8 << 20 | 8 << 24 | (15 << 28)) - 2**32
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    assert torch.equal(ct.pack_to_int32(q, 4), packed)
    assert torch.equal(ct.unpack_from_int32(packed, 4, torch.Size([6, 40])), q)


def test_ignore_matching_is_compressed_tensors():
    assert is_ignored("lm_head", KIMI_IGNORE) and not is_ignored("model.lm_head", ["lm_head"])
    assert is_ignored("model.layers.3.self_attn.kv_b_proj", KIMI_IGNORE)
    assert is_ignored("model.layers.0.mlp.down_proj", KIMI_IGNORE)
    assert is_ignored("model.layers.3.mlp.shared_experts.up_proj", KIMI_IGNORE)
    assert not is_ignored("model.layers.3.mlp.experts.17.gate_proj", KIMI_IGNORE)
    assert is_ignored("language_model.lm_head", KIMI25_IGNORE)
    mt = pytest.importorskip("compressed_tensors.utils.match")
    for name in ("lm_head", "model.layers.1.mlp.experts.0.up_proj", "model.layers.1.self_attn.o_proj"):
        assert is_ignored(name, KIMI_IGNORE) == any(mt.match_name(name, p) for p in KIMI_IGNORE)


def test_config_parsing_and_refusals():
    assert parse_quant_config({"quantization_config": quant_config(KIMI_IGNORE)}).group_size == GROUP
    assert parse_quant_config({"text_config": {"quantization_config": quant_config(KIMI25_IGNORE)}}).ignore \
        == tuple(KIMI25_IGNORE)
    assert parse_quant_config({}) is None
    for path, value, msg in ((("weights", "symmetric"), False, "symmetric"),
                             (("weights", "num_bits"), 8, "num_bits"),
                             (("weights", "strategy"), "channel", "strategy"),
                             (("input_activations",), {"num_bits": 8}, "activations")):
        q = quant_config([])
        node = q["config_groups"]["group_0"]
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        with pytest.raises(ConfigError, match=msg):
            parse_quant_config({"quantization_config": q})
    with pytest.raises(ConfigError, match="format"):
        parse_quant_config({"quantization_config": quant_config([]) | {"format": "float-quantized"}})


# ---- loading and running ----------------------------------------------------------------------
def test_kimi_layout_stays_packed_and_matches_the_dequantized_copy(kimi):
    packed_dir, deq_dir = kimi
    model = draftsman.load_target(packed_dir, dtype=torch.bfloat16)
    ref = draftsman.load_target(deq_dir, dtype=torch.bfloat16)
    experts = model.layers[1].mlp.experts
    assert type(experts).__name__ == "PackedExperts" and experts.gate_proj_packed.dtype == torch.int32
    assert not any(isinstance(m, PackedInt4Linear) for m in model.modules())  # attention etc. ignored
    assert isinstance(model.layers[1].self_attn.kv_b_proj, torch.nn.Linear)
    with safe_open(str(packed_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(experts.down_proj_packed[3], f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight_packed"))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), ref(ids))
    for a, b in zip(model.run(ids, aux_layer_ids=[1, 2, 4]).aux_hidden, ref.run(ids, aux_layer_ids=[1, 2, 4]).aux_hidden,
                    strict=True):
        assert torch.equal(a, b)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    ref_weights = sum(t.numel() * t.element_size() for t in ref.parameters())
    assert weights < ref_weights  # the experts are held in 4 bits


def test_all_linear_packed_fp32_and_cached_decoding(all_linear):
    packed_dir, deq_dir = all_linear
    model = draftsman.load_target(packed_dir)  # fp32: exact products of int4 and scale,
    ref = draftsman.load_target(deq_dir)  # against an fp32 dequantized copy
    assert isinstance(model.layers[0].self_attn.kv_b_proj, PackedInt4Linear)
    assert isinstance(model.layers[0].mlp.down_proj, PackedInt4Linear)
    assert isinstance(model.lm_head, torch.nn.Linear)
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(ids), ref(ids))
    assert torch.equal(greedy_cached(model, ids, 8), greedy_cached(ref, ids, 8))  # absorbed MLA decode


def test_transformers_compressed_tensors_agrees(kimi):
    """HF transformers + compressed-tensors decompress the packed checkpoint to exactly the
    dequantized copy draftsman matches bit for bit (so draftsman's unpacking is theirs)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    packed_dir, deq_dir = kimi
    try:
        hf = AutoModelForCausalLM.from_pretrained(packed_dir, dtype=torch.bfloat16).eval()
    except Exception as e:  # transformers' quantizer support varies with versions
        pytest.skip(f"transformers cannot load pack-quantized here: {e}")
    hf_deq = AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs, theirs_deq = hf(ids).logits, hf_deq(ids).logits
    assert torch.equal(theirs, theirs_deq)
    ours = draftsman.load_target(packed_dir, dtype=torch.bfloat16)(ids)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=1e-2)  # bf16 kernels differ


def test_kimi_k25_wrapped_layout(tiny_deepseek_dir, tmp_path):
    packed_dir, deq_dir = write_packed(tiny_deepseek_dir, tmp_path, KIMI25_IGNORE, wrap=True)
    model = draftsman.load_target(packed_dir, dtype=torch.bfloat16)
    assert type(model.layers[2].mlp.experts).__name__ == "PackedExperts"
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(ids), draftsman.load_target(deq_dir, dtype=torch.bfloat16)(ids))


def test_ignore_list_is_honoured(kimi, tmp_path):
    packed_dir, _ = kimi
    cfg = json.loads((packed_dir / "config.json").read_text())
    # a packed module the config says stays full precision
    bad = tmp_path / "a"
    shutil.copytree(packed_dir, bad)
    (bad / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant_config(
        [*KIMI_IGNORE, "re:.*experts.*"])}))
    with pytest.raises(CheckpointError, match="full precision, but the checkpoint stores them packed"):
        draftsman.load_target(bad)
    # a Linear the config says is quantized, stored unpacked
    bad = tmp_path / "b"
    shutil.copytree(packed_dir, bad)
    (bad / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant_config(["lm_head"])}))
    with pytest.raises(CheckpointError, match="should be packed"):
        draftsman.load_target(bad)


def test_wrong_weight_shape_is_caught(kimi, tmp_path):
    packed_dir, _ = kimi
    bad = tmp_path / "c"
    shutil.copytree(packed_dir, bad)
    with safe_open(str(bad / "model.safetensors"), "pt") as f:
        t = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    t["model.layers.2.mlp.experts.1.up_proj.weight_shape"] = torch.tensor([32, 63])
    save_file(t, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts.1.up_proj.weight_shape"):
        draftsman.load_target(bad)


def test_dequantize_rounds_once_like_compressed_tensors():
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    q, scale = quantize_int4(w, GROUP)
    ours = dequantize(pack_int4(q), scale, 64, GROUP, torch.bfloat16)
    theirs = q.to(torch.bfloat16) * scale.repeat_interleave(GROUP, -1)  # compressed-tensors' _dequantize
    assert torch.equal(ours, theirs)


def test_packed_target_splits_over_devices(kimi):
    """INT4 and pipeline placement together (how a Kimi checkpoint meets 8 GPUs): the split is
    sized by packed bytes and computes the same."""
    packed_dir, _ = kimi
    plain = draftsman.load_target(packed_dir, dtype=torch.bfloat16)
    split = draftsman.load_target(packed_dir, dtype=torch.bfloat16, device_map=["cpu", "cpu"])
    assert type(split.layers[3].mlp.experts).__name__ == "PackedExperts"
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(4))
    assert torch.equal(plain(ids), split(ids))
    assert torch.equal(greedy_cached(plain, ids, 4), greedy_cached(split, ids, 4))
