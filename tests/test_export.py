"""draftsman export / import: round trips through every format (identical tensors, identical
speculative decoding), each config checked key by key against what its engine reads (SGLang
llama_eagle3.py + model_runner, vLLM llama_eagle3.py + eagle3 aux helpers + speculators config
path), the `speculators` package's own config classes, and imports of foreign layouts
(SafeAILab/EAGLE, SGLang/SpecForge, speculators, SpecForge training states)."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import draftsman
from draftsman.cli import main as cli_main
from draftsman.config import ConfigError
from draftsman.generate import StopRules, generate_plain
from draftsman.interop.export import TargetRef, export_drafter, resolve_target
from draftsman.interop.formats import (
    KEY_REASONS,
    SPECULATORS_CONFIG_REASONS,
    TRANSFORMER_LAYER_REASONS,
    check_reasons,
    yarn_mscale,
)
from draftsman.models.eagle3 import init_drafter, load_drafter, save_drafter
from draftsman.models.layers import rope_inv_freq
from draftsman.spec.engine import SpecConfig, SpecEngine
from draftsman.weights import CheckpointError

FORMATS = ("sglang", "vllm", "speculators")
AUX = (0, 2, 3)  # includes 0 (embedding output): SGLang's spelling of it is -1
DRAFT_VOCAB = 96


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return draftsman.load_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def drafter(target):
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].sort().values
    return init_drafter(target, draft_vocab_size=DRAFT_VOCAB, draft_token_ids=ids, aux_layer_ids=AUX,
                        seed=1, std=0.2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, drafter, tiny_llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    ref = resolve_target(str(tiny_llama_dir))
    return {fmt: export_drafter(drafter, fmt, root / fmt, ref, torch.float32).out for fmt in FORMATS}


def read_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def spec_tokens(target, drafter, prompts, n=12):
    out = SpecEngine(target, drafter, SpecConfig(steps=3, topk=2, draft_tokens=6)).generate(
        prompts, StopRules(max_new_tokens=n))
    return out.token_ids, out.stats["accept_length"]


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_identical_tensors_config_and_decoding(fmt, exported, drafter, target):
    back = load_drafter(exported[fmt], target=target)
    assert back.source_format == ("speculators" if fmt == "speculators" else "draftsman")
    ours, theirs = drafter.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert theirs[name].dtype == t.dtype and torch.equal(theirs[name], t), name
    assert back.aux_layer_ids == AUX and back.config.layer_id_convention == "input"
    assert torch.equal(back.draft_token_ids, drafter.draft_token_ids)
    a, b = drafter.config, back.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size",
                "max_position_embeddings", "norm_before_residual"):
        assert getattr(a, key) == getattr(b, key), key
    # RoPE: the same frequencies and scale (llama3 scaling from the target, theta 500000)
    assert b.rope.theta == 500000.0 and b.rope.type == "llama3"
    assert torch.equal(back.rotary.inv_freq, drafter.rotary.inv_freq)
    assert back.rotary.attention_factor == drafter.rotary.attention_factor

    prompts = [[5, 9, 17, 33], [7, 7, 40, 2, 90, 11]]
    tokens, tau = spec_tokens(target, drafter, prompts)
    tokens2, tau2 = spec_tokens(target, back, prompts)
    assert tokens2 == tokens and tau2 == tau
    assert tokens == generate_plain(target, prompts, StopRules(max_new_tokens=12)).token_ids


def test_export_of_an_import_is_stable(exported, tmp_path):
    """speculators -> draftsman -> sglang -> draftsman: every hop keeps tensors and ids."""
    d = load_drafter(exported["speculators"])
    again = export_drafter(d, "sglang", tmp_path / "s").out
    assert load_file(again / "model.safetensors").keys() == load_file(exported["sglang"] / "model.safetensors").keys()
    for name, t in load_file(exported["sglang"] / "model.safetensors").items():
        assert torch.equal(load_file(again / "model.safetensors")[name], t)
    assert read_config(again)["eagle_config"] == read_config(exported["sglang"])["eagle_config"]


# ---- key by key against the engines --------------------------------------------------------------
def sglang_capture(eagle_config_ids: list[int]) -> list[int]:
    """SGLang set_eagle3_layers_to_capture: layers_to_capture = [val + 1 for val in layer_ids],
    and LlamaModel.forward appends hidden_states + residual BEFORE layer i (its input)."""
    return [v + 1 for v in eagle_config_ids]


def test_sglang_reads_every_key_as_meant(exported, drafter, target):
    cfg = read_config(exported["sglang"])
    assert not check_reasons(cfg, "sglang") and set(KEY_REASONS["sglang"]) == set(cfg)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    # model_runner: eagle_config["eagle_aux_hidden_state_layer_ids"], use_aux_hidden_state
    ec = cfg["eagle_config"]
    assert ec["use_aux_hidden_state"] is True and ec["eagle_aux_hidden_state_layer_ids"] == [-1, 1, 2]
    captured = sglang_capture(ec["eagle_aux_hidden_state_layer_ids"])
    assert tuple(captured) == AUX
    ids = torch.tensor([[3, 50, 7, 9]])
    run = target.run(ids, aux_layer_ids=captured)
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(target.source_dir)
    hs = hf(ids, output_hidden_states=True).hidden_states
    for i, h in zip(AUX, run.aux_hidden, strict=True):  # input of layer i == HF hidden_states[i]
        torch.testing.assert_close(h, hs[i], rtol=1e-4, atol=1e-5)
    # LlamaModel: fc in = 3 * target_hidden_size; LlamaForCausalLMEagle3: lm_head rows = draft_vocab_size
    assert cfg["target_hidden_size"] * 3 == drafter.fc.in_features
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["tie_word_embeddings"] is False
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_act"] == "silu"
    # get_rope(llama3) indexes original_max_position_embeddings
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_parameters"]["rope_theta"] == 500000.0
    # load_weights: d2t -> hot_token_id = d2t + arange; t2d skipped; q/k/v -> qkv_proj, gate/up ->
    # gate_up_proj; a name not in params gets "model." prepended; unknown names are dropped
    # silently, so every tensor must land on a real parameter.
    params = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
              *(f"model.midlayer.{n}" for n in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                                                 "input_layernorm.weight", "hidden_norm.weight",
                                                 "post_attention_layernorm.weight"))}
    tensors = load_file(exported["sglang"] / "model.safetensors")
    landed = set()
    for name, t in tensors.items():
        if "d2t" in name:
            assert torch.equal(t + torch.arange(t.shape[0]), drafter.draft_token_ids)
            continue
        if "t2d" in name:
            continue
        for shard in (".q_proj", ".k_proj", ".v_proj"):
            name = name.replace(shard, ".qkv_proj")
        for shard in (".gate_proj", ".up_proj"):
            name = name.replace(shard, ".gate_up_proj")
        landed.add(name if name in params else f"model.{name}")
    assert landed <= params and landed == params - {"model.embed_tokens.weight"}


def vllm_param_name(name: str) -> str | None:
    """vLLM Eagle3LlamaForCausalLM.load_weights + LlamaModel.load_weights name mapping
    (None = skipped). params_dict[name] raises KeyError for anything else."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
        if shard in name:
            return name.replace(shard, fused)
    return name


VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
               "model.embed_tokens.weight",
               *(f"model.layers.0.{n}" for n in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                                  "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                                                  "input_layernorm.weight", "hidden_norm.weight",
                                                  "post_attention_layernorm.weight"))}


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_loads_every_tensor(fmt, exported):
    names = {vllm_param_name(n) for n in load_file(exported[fmt] / "model.safetensors")} - {None}
    assert names == VLLM_PARAMS - {"model.embed_tokens.weight"}  # embedding shared with the target


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_transformers_autoconfig_reads_flat_exports(fmt, exported):
    """Both engines build the draft hf_config with transformers' AutoConfig first."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(exported[fmt])
    assert type(c).__name__ == "LlamaConfig" and c.num_hidden_layers == 1 and c.head_dim == 16
    assert c.eagle_config["eagle_aux_hidden_state_layer_ids"] == [-1, 1, 2]
    assert tuple(c.eagle_aux_hidden_state_layer_ids) == AUX
    assert c.draft_vocab_size == DRAFT_VOCAB and c.target_hidden_size == 64
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    assert c.rope_parameters["original_max_position_embeddings"] == 64


def test_vllm_reads_every_key_as_meant(exported, drafter):
    cfg = read_config(exported["vllm"])
    assert not check_reasons(cfg, "vllm")
    # get_eagle3_aux_layers_from_config: getattr(hf_config, "eagle_aux_hidden_state_layer_ids"), as given;
    # the Llama target then appends hidden_states + residual before layer idx (its input).
    assert tuple(cfg["eagle_aux_hidden_state_layer_ids"]) == AUX
    assert cfg["norm_before_residual"] is False  # getattr(config, "norm_before_residual", False)
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True  # LlamaModel.use_aux_hidden_state
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 64
    assert cfg["max_position_embeddings"] == 512


def vllm_capture_ids(cfg: dict) -> tuple[int, ...] | None:
    """vLLM 0.32 GPUModelRunner._get_eagle3_aux_layers_from_config (the V1 runner, also the CPU
    build's): the top-level ids, else eagle_config's ids AS GIVEN (no +1, unlike SGLang)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else None


def vllm_fc_in_features(cfg: dict) -> int:
    """vLLM 0.32 llama_eagle3.LlamaModel: fc input = target_hidden_size x num_aux_hidden_states,
    the count taken from num_aux_hidden_states, else len(eagle_config ids), else 3."""
    n = cfg.get("num_aux_hidden_states")
    if n is None:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return cfg.get("target_hidden_size", cfg["hidden_size"]) * n


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_vllm_capture_ids_and_fc_width_of_flat_exports(fmt, exported, drafter):
    """Checked against vLLM 0.32 (CPU build) serving the SmolLM2 drafter: it logged 'Using
    auxiliary layers from speculative config: (2, 15, 27)' and matched draftsman's acceptance."""
    cfg = read_config(exported[fmt])
    assert vllm_capture_ids(cfg) == AUX
    assert vllm_fc_in_features(cfg) == drafter.fc.in_features
    # the top-level key is load-bearing: without it vLLM captures eagle_config's output-of-layer
    # ids as given, one layer early
    bare = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert vllm_capture_ids(bare) == tuple(i - 1 for i in AUX)


def vllm_from_speculators(config_dict: dict) -> tuple[dict, dict]:
    """vLLM SpeculatorsConfig.extract_transformers_pre_trained_config + update_eagle3, and
    build_vllm_speculative_config (transformers_utils/configs/speculators/)."""
    spec = config_dict["speculators_config"]
    _ = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
    assert config_dict["speculators_model_type"] == "eagle3"
    pre = dict(config_dict["transformer_layer_config"])
    pre["draft_vocab_size"] = config_dict.get("draft_vocab_size")
    if config_dict.get("target_hidden_size") is not None:
        pre["target_hidden_size"] = config_dict["target_hidden_size"]
    pre["norm_before_residual"] = config_dict.get("norm_before_residual", True)
    pre["architectures"] = ["Eagle3LlamaForCausalLM"]
    if config_dict.get("eagle_aux_hidden_state_layer_ids"):
        pre["eagle_aux_hidden_state_layer_ids"] = config_dict["eagle_aux_hidden_state_layer_ids"]
    pre.setdefault("num_lookahead_tokens", spec["proposal_methods"][0]["speculative_tokens"])
    vllm_spec = {"method": config_dict["speculators_model_type"],
                 "num_speculative_tokens": spec["proposal_methods"][0]["speculative_tokens"]}
    return pre, vllm_spec


def test_speculators_layout_as_vllm_reads_it(exported, tiny_llama_dir):
    cfg = read_config(exported["speculators"])
    assert not check_reasons(cfg, "speculators") and set(KEY_REASONS["speculators"]) == set(cfg)
    assert set(cfg["transformer_layer_config"]) == set(TRANSFORMER_LAYER_REASONS)
    assert set(cfg["speculators_config"]) == set(SPECULATORS_CONFIG_REASONS)
    pre, vllm_spec = vllm_from_speculators(cfg)
    assert vllm_spec == {"method": "eagle3", "num_speculative_tokens": 3}
    assert pre["norm_before_residual"] is False  # explicit: vLLM would default to True
    assert tuple(pre["eagle_aux_hidden_state_layer_ids"]) == AUX
    assert pre["draft_vocab_size"] == DRAFT_VOCAB and pre["vocab_size"] == 256 and pre["target_hidden_size"] == 64
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str(tiny_llama_dir),
                                                     "architectures": ["LlamaForCausalLM"]}
    names = load_file(exported["speculators"] / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)


def test_speculators_package_accepts_the_export(exported):
    """The real `speculators` package (installed without its CUDA torch pin) parses the config
    with its own classes and loads the directory with Eagle3DraftModel.from_pretrained: every
    exported tensor arrives under its name, bit for bit."""
    try:  # installed with --no-deps (its pin would replace the CPU torch): skip if partial
        from speculators import SpeculatorModelConfig
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
    except ImportError as e:
        pytest.skip(f"speculators not importable here: {e}")

    raw = read_config(exported["speculators"])
    cfg = SpeculatorModelConfig.from_dict(raw)
    assert isinstance(cfg, Eagle3SpeculatorConfig)
    assert cfg.speculators_config.algorithm == "eagle3"
    assert cfg.speculators_config.default_proposal_method == "greedy"
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert cfg.eagle_aux_hidden_state_layer_ids == list(AUX) and cfg.norm_before_residual is False
    layer = cfg.transformer_layer_config
    assert type(layer).__name__ == "LlamaConfig" and layer.vocab_size == 256 and layer.head_dim == 16
    assert layer.rope_parameters["rope_type"] == "llama3" and layer.rope_parameters["rope_theta"] == 500000.0
    try:
        from speculators.models.eagle3.core import Eagle3DraftModel
    except Exception as e:  # the model module needs more of speculators' training stack
        pytest.skip(f"speculators' Eagle3DraftModel unavailable here: {e}")
    # from_pretrained: HF loading of our safetensors (+ the verifier's embedding and head, read
    # from the local target directory the config names)
    model = Eagle3DraftModel.from_pretrained(str(exported["speculators"]))
    theirs = model.state_dict()
    ours = load_file(exported["speculators"] / "model.safetensors")
    for name, t in ours.items():
        assert name in theirs and torch.equal(theirs[name], t), name
    missing = set(theirs) - set(ours)
    assert missing <= set(Eagle3DraftModel._keys_to_ignore_on_load_missing), missing
    assert model.target_layer_ids == list(AUX)


def test_yarn_scale_matches_the_engines_formula(target):
    """vLLM/SGLang YaRN scale cos/sin by yarn_get_mscale(factor) * attn_factor; HF/draftsman by the
    attention factor from mscale/mscale_all_dim (DeepSeek/Kimi style). The export makes them agree."""
    from dataclasses import replace

    from draftsman.config import RopeConfig
    from draftsman.interop.formats import rope_scaling_dict

    rope = RopeConfig(theta=50000.0, type="yarn", factor=32.0, original_max_position_embeddings=4096,
                      mscale=1.0, mscale_all_dim=1.0)
    factor = rope_inv_freq(rope, 64, 131072)[1]
    assert factor == 1.0  # equal mscales cancel in HF
    scaling = rope_scaling_dict(rope, 131072, factor)
    assert math.isclose(yarn_mscale(scaling["factor"]) * scaling["attn_factor"], factor)
    plain = replace(rope, mscale=None, mscale_all_dim=None)
    scaling = rope_scaling_dict(plain, 131072, rope_inv_freq(plain, 64, 131072)[1])
    assert math.isclose(scaling["attn_factor"], 1.0)  # plain YaRN: the engines' default


def test_window_raised_to_the_target_with_frequencies_pinned(target, tiny_llama_dir, tmp_path):
    d = init_drafter(target, aux_layer_ids=AUX, seed=0)
    object.__setattr__(d, "config", __import__("dataclasses").replace(d.config, max_position_embeddings=128))
    res = export_drafter(d, "sglang", tmp_path / "e", resolve_target(str(tiny_llama_dir)))
    cfg = res.config
    assert cfg["max_position_embeddings"] == 512 and cfg["draftsman"]["drafter_max_position_embeddings"] == 128
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    assert any("128 -> 512" in n for n in res.notes)


def test_export_refusals(target, drafter, tmp_path):
    no_ids = init_drafter(target, seed=0)
    no_ids.aux_layer_ids = None
    with pytest.raises(ConfigError, match="pass --target"):
        export_drafter(no_ids, "vllm", tmp_path / "a")
    with pytest.raises(ConfigError, match="names its verifier"):
        export_drafter(drafter, "speculators", tmp_path / "b")
    narrow = init_drafter(target, hidden_size=32, aux_layer_ids=AUX, seed=0)
    with pytest.raises(ConfigError, match="SGLang"):
        export_drafter(narrow, "sglang", tmp_path / "c")
    export_drafter(narrow, "vllm", tmp_path / "d")  # vLLM loads the drafter's own embed_tokens
    assert "embed_tokens.weight" in load_file(tmp_path / "d" / "model.safetensors")
    other = TargetRef("x", draftsman.config.parse_target_config(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 8,
         "num_hidden_layers": 2, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="vocab_size=256, target vocab_size=300"):
        export_drafter(drafter, "vllm", tmp_path / "e", other)


# ---- imports of foreign layouts ---------------------------------------------------------------------
def hf_layer(h: int = 64, **over) -> dict:
    raw = {"hidden_size": h, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 256, "max_position_embeddings": 2048,
           "hidden_act": "silu", "tie_word_embeddings": False}
    return raw | over


def random_tensors(prefix: str = "midlayer.", draft_vocab: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g) * 0.1

    t = {"fc.weight": r(64, 192), "norm.weight": 1 + r(64), "lm_head.weight": r(draft_vocab, 64)}
    for n, s in (("input_layernorm.weight", (64,)), ("hidden_norm.weight", (64,)),
                 ("post_attention_layernorm.weight", (64,)), ("self_attn.q_proj.weight", (64, 128)),
                 ("self_attn.k_proj.weight", (32, 128)), ("self_attn.v_proj.weight", (32, 128)),
                 ("self_attn.o_proj.weight", (64, 64)), ("mlp.gate_proj.weight", (96, 64)),
                 ("mlp.up_proj.weight", (96, 64)), ("mlp.down_proj.weight", (64, 96))):
        t[prefix + n] = r(*s) + (1 if "norm" in n else 0)
    ids = torch.arange(0, 2 * draft_vocab, 2)
    t["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    return t


def test_import_safailab_eagle_bin(tmp_path, target):
    """yuhuili/EAGLE3-* layout: no rope_theta, no ids, pytorch_model.bin."""
    d = tmp_path / "eagle"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                               "draft_vocab_size": 64, "torch_dtype": "float16", **hf_layer()}))
    torch.save(random_tensors(), d / "pytorch_model.bin")
    dr = load_drafter(d, target=target)
    assert dr.source_format == "eagle" and dr.config.layer_id_convention is None
    assert dr.aux_layer_ids == target.config.default_aux_layer_ids()  # what EAGLE's modeling captures
    assert dr.config.rope.theta == 10000.0


def test_import_sglang_specforge_dir(tmp_path, target):
    d = tmp_path / "sf"
    d.mkdir()
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64, **hf_layer(),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    (d / "config.json").write_text(json.dumps(raw))
    save_file(random_tensors(), d / "model.safetensors")
    dr = load_drafter(d, target=target)
    assert dr.source_format == "sglang" and dr.config.layer_id_convention == "output"
    assert dr.aux_layer_ids == (1, 2, 3)


def test_import_handwritten_speculators_dir(tmp_path, target):
    """As speculators' converter writes it: LlamaConfig.to_diff_dict() layer config (transformers 5
    rope_parameters), layers.0.* names, the verifier's embed_tokens copy, a verifier norm."""
    from transformers import LlamaConfig

    layer = LlamaConfig(**hf_layer(rms_norm_eps=1e-6), num_hidden_layers=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}).to_diff_dict()
    for key in ("rms_norm_eps", "hidden_act", "max_position_embeddings"):  # transformers 4's diff drops
        layer.pop(key, None)  # keys equal to LlamaConfig's defaults: the import must know those
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 64,
           "norm_before_residual": True, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [1, 2, 4],
           "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                  "verifier": {"name_or_path": "meta-llama/x", "architectures": ["LlamaForCausalLM"]}}}
    d = tmp_path / "spec"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    t = random_tensors("layers.0.")
    t["embed_tokens.weight"] = target.embed_tokens.weight.clone()
    save_file(t, d / "model.safetensors")
    dr = load_drafter(d, target=target)
    assert dr.source_format == "speculators" and dr.config.layer_id_convention == "input"
    assert dr.aux_layer_ids == (1, 2, 4) and dr.config.norm_before_residual is True
    assert dr.config.rope.theta == 1e6 and dr.config.rms_norm_eps == 1e-6
    assert dr.config.max_position_embeddings == 2048
    assert torch.equal(dr.midlayer.self_attn.q_proj.weight, t["layers.0.self_attn.q_proj.weight"])
    assert any("identical to the target's" in n for n in dr.notes)
    assert any("meta-llama/x" in n for n in dr.notes)


def specforge_state(draft_vocab: int = 64, **extra) -> dict:
    weights = random_tensors(draft_vocab=draft_vocab, seed=5)
    return {"draft_state_dict": weights, "global_step": 40, "epoch": 1, "strategy": "eagle3", "run_id": "run",
            "world_size": 8, "replicated_optimizer_state": {
                "state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.zeros(3)}},
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "params": [0]}]}, **extra}


@pytest.fixture
def specforge_run(tmp_path) -> tuple[Path, Path]:
    """SpecForge's CheckpointManager layout: OUT/{run}-step{N}/training_state.pt, OUT/{run}-latest."""
    out = tmp_path / "sf-out"
    for step in (20, 40):
        (out / f"run-step{step}").mkdir(parents=True)
        torch.save(specforge_state() | {"global_step": step}, out / f"run-step{step}" / "training_state.pt")
    os.symlink(out / "run-step20", out / "run-latest")  # the pointer wins over the highest step
    cfg = tmp_path / "llama-eagle3.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64, **hf_layer(),
                               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}))
    return out, cfg


def test_import_specforge_training_state(specforge_run, target, tmp_path):
    out, cfg = specforge_run
    weights = specforge_state()["draft_state_dict"]
    for path in (out, out / "run-step40", out / "run-step40" / "training_state.pt"):
        dr = load_drafter(path, target=target, draft_config=cfg)
        assert dr.source_format == "specforge-state" and dr.aux_layer_ids == (2, 3, 4)
        assert torch.equal(dr.fc.weight, weights["fc.weight"])
    assert any("step 20" in n for n in load_drafter(out, draft_config=cfg).notes)
    with pytest.raises(ConfigError, match="does not carry its draft config"):
        load_drafter(out / "run-step40")
    # the export CLI takes it too, then generate/train --init take the export
    rc = cli_main(["export", "--drafter", str(out), "--draft-config", str(cfg), "--to", "sglang",
                   "--out", str(tmp_path / "x")])
    assert rc == 0 and load_drafter(tmp_path / "x").aux_layer_ids == (2, 3, 4)


class _Boom:
    """Unpickling this would run code; weights_only loading must refuse it."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/draftsman-pwned-by-state",))


def test_training_state_is_never_unpickled_unsafely(tmp_path, target):
    import argparse

    marker = Path("/tmp/draftsman-pwned-by-state")
    marker.unlink(missing_ok=True)
    d = tmp_path / "bad"
    d.mkdir()
    torch.save(specforge_state(args=argparse.Namespace(lr=1.0), boom=_Boom()), d / "training_state.pt")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **hf_layer()}))
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_drafter(d)
    assert not marker.exists()
    assert pickle.DEFAULT_PROTOCOL  # (pickle imported for the reducer above)


def test_cli_generate_and_train_init_accept_exports(exported, tiny_llama_dir, tmp_path, capsys):
    rc = cli_main(["generate", "--target", str(tiny_llama_dir), "--drafter", str(exported["speculators"]),
                   "--prompt-ids", "5,9,17", "--max-new-tokens", "6", "--device", "cpu", "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    target = draftsman.load_target(tiny_llama_dir)
    assert got["token_ids"] == generate_plain(target, [[5, 9, 17]], StopRules(max_new_tokens=6)).token_ids[0]

    from draftsman.train.data import TokenizedConversation
    from draftsman.train.trainer import TrainConfig, train

    ex = [TokenizedConversation([5, 9, 17, 40, 41, 42], [0, 0, 0, 1, 1, 1])] * 2
    cfg = TrainConfig(target=str(tiny_llama_dir), out=str(tmp_path / "t"), init=str(exported["speculators"]),
                      ttt_steps=2, max_steps=1, batch_size=2, device="cpu", progress=False)
    res = train(cfg, examples=ex)
    assert res.global_step == 1
    assert load_drafter(tmp_path / "t").aux_layer_ids == AUX


def test_cli_export_prints_conventions(exported, tiny_llama_dir, tmp_path, capsys):
    src = tmp_path / "native"
    save_drafter(load_drafter(exported["vllm"]), src)
    rc = cli_main(["export", "--drafter", str(src), "--to", "speculators", "--out", str(tmp_path / "o"),
                   "--target", str(tiny_llama_dir), "--spec-steps", "5", "--json"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    got = json.loads(lines[-1])
    assert got["source_format"] == "draftsman" and got["aux_layer_ids"] == {"eagle_aux_hidden_state_layer_ids": list(AUX)}
    assert read_config(tmp_path / "o")["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert any(line.startswith("wrote eagle_aux_hidden_state_layer_ids = [0, 2, 3]") for line in lines)
    assert read_config(tmp_path / "o")["torch_dtype"] == "float32"
