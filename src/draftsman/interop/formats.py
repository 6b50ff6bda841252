"""Drafter config.json for each serving engine, built from a DrafterConfig, and the reverse
translation for the `speculators` layout. Pure functions over dicts.

Every key written is listed in KEY_REASONS with the engine code that reads it (checked against
SGLang python/sglang/srt/models/llama_eagle3.py + model_executor/model_runner.py, vLLM
vllm/model_executor/models/llama_eagle3.py + eagle3 aux-layer helpers +
transformers_utils/configs/speculators/, and the `speculators` package's Eagle3SpeculatorConfig);
tests hold the writers to that list, so a key without a reason cannot be added silently.

Aux layer ids (DESIGN.md): draftsman's id i = residual stream entering target layer i.
  SGLang reads eagle_config.eagle_aux_hidden_state_layer_ids and captures layer id+1's input,
  so it gets i-1. vLLM reads the top-level eagle_aux_hidden_state_layer_ids as given, so it gets
  i. Flat exports carry both spellings, so one directory serves both engines, plus a `draftsman`
  block that says which convention is which. vLLM (0.32) also reads the eagle_config list: its
  length sizes fc (num_aux_hidden_states), and its model runner falls back to those ids AS GIVEN
  when the top-level key is absent, i.e. one layer early: the top-level key is load-bearing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftsman.config import ConfigError, DrafterConfig, RopeConfig

EXPORT_FORMATS = ("sglang", "vllm", "speculators")
FLAT_ARCH = "LlamaForCausalLMEagle3"  # SGLang's EntryClass name; vLLM registers it too
SPECULATORS_ARCH = "Eagle3Speculator"


@dataclass(frozen=True)
class ExportSpec:
    """What an export needs besides the drafter's own config."""

    aux_layer_ids: tuple[int, ...]  # draftsman convention: input of target layer i
    torch_dtype: str  # dtype the tensors are written in
    max_position_embeddings: int  # may exceed the drafter's own to cover the target's window
    own_embedding: bool = False
    verifier_name_or_path: str | None = None  # speculators: the target the drafter serves
    verifier_architectures: tuple[str, ...] = ()
    speculative_tokens: int = 3  # speculators: default num_speculative_tokens for vLLM
    source_format: str | None = None


# ---- per-key reasons ---------------------------------------------------------------------------
_LLAMA_LAYER = {
    "hidden_size": "width of the drafter layer, fc output, norm and lm_head input",
    "intermediate_size": "LlamaMLP gate/up/down width",
    "num_hidden_layers": "1: one EAGLE-3 midlayer (SGLang adds BasicDecoderLayers past 1; vLLM builds "
                         "that many layers, layer 0 reading 2H)",
    "num_attention_heads": "QKVParallelLinear(2H, head_dim, heads, kv_heads)",
    "num_key_value_heads": "QKVParallelLinear kv heads (GQA)",
    "head_dim": "LlamaAttention head_dim (getattr(config, 'head_dim', H // heads))",
    "hidden_act": "LlamaMLP activation ('silu')",
    "rms_norm_eps": "every RMSNorm of the drafter",
    "vocab_size": "the TARGET vocabulary: embed_tokens size and the width of t2d / logits remap",
    "max_position_embeddings": "rotary cache length; SGLang refuses a draft whose window is shorter "
                               "than the target's context (model_config._derive_context_length)",
    "rope_theta": "LlamaAttention rotary base (SGLang getattr(config, 'rope_theta'); vLLM "
                  "patch_rope_parameters under transformers 4)",
    "rope_scaling": "rotary scaling (legacy spelling SGLang and transformers-4 vLLM read); "
                    "llama3/yarn carry original_max_position_embeddings, which get_rope indexes",
    "rope_parameters": "transformers-5 spelling of theta + scaling (vLLM / HF under transformers 5)",
    "attention_bias": "False: QKVParallelLinear(bias=False) as trained",
    "mlp_bias": "False: LlamaMLP without biases",
    "tie_word_embeddings": "False: SGLang would alias lm_head to embed_tokens when true",
    "torch_dtype": "dtype of the stored tensors (HF from_pretrained / engines' 'auto' dtype)",
}
_FLAT = {
    "architectures": "SGLang ModelRegistry -> llama_eagle3.LlamaForCausalLMEagle3; vLLM registry "
                     "maps LlamaForCausalLMEagle3 -> llama_eagle3.Eagle3LlamaForCausalLM",
    "model_type": "'llama': AutoConfig builds a LlamaConfig, which both engines' layers read",
    **_LLAMA_LAYER,
    "draft_vocab_size": "rows of lm_head (ParallelLMHead); absent, SGLang would load the target's "
                        "lm_head and vLLM assume the full vocabulary",
    "target_hidden_size": "fc input = 3 x target_hidden_size (hasattr check in both engines)",
    "norm_before_residual": "vLLM LlamaDecoderLayer: residual = hidden_norm(h) when true; written "
                            "explicitly (SGLang has no such option: always false)",
    "eagle_config": "SGLang model_runner reads eagle_config['eagle_aux_hidden_state_layer_ids'] "
                    "(output-of-layer ids, +1 in set_eagle3_layers_to_capture) and "
                    "use_aux_hidden_state; vLLM llama_eagle3.LlamaModel reads use_aux_hidden_state, "
                    "norm_before_fc and the id list's LENGTH (num_aux_hidden_states: fc input = "
                    "target_hidden_size x len), and GPUModelRunner._get_eagle3_aux_layers_from_config "
                    "takes these ids as given only when the top-level key is absent",
    "eagle_aux_hidden_state_layer_ids": "vLLM get_eagle3_aux_layers_from_config: "
                                        "hf_config.eagle_aux_hidden_state_layer_ids, input-of-layer "
                                        "ids taken as given",
    "draftsman": "draftsman's own record: ids in its input convention, source format; ignored by "
                 "the engines (PretrainedConfig keeps unknown keys as attributes)",
}
_SPECULATORS = {
    "architectures": "speculators registry name; vLLM's speculators path replaces it with "
                     "Eagle3LlamaForCausalLM",
    "speculators_model_type": "'eagle3': vLLM SUPPORTED_SPECULATORS_TYPES key and the speculators "
                              "registry discriminator (SpeculatorModelConfig.from_dict)",
    "speculators_version": "speculators' SpeculatorModelConfig field",
    "speculators_config": "algorithm / proposal_methods / default_proposal_method / verifier: "
                          "validated by speculators' SpeculatorsConfig; vLLM takes "
                          "proposal_methods[0].speculative_tokens as num_speculative_tokens and "
                          "verifier.name_or_path as the target when serving the drafter directory",
    "transformer_layer_config": "the Llama decoder layer's config: vLLM uses it as the draft "
                                "hf_config; speculators builds it with AutoConfig.for_model",
    "draft_vocab_size": "vLLM update_eagle3 and speculators: rows of lm_head, size of d2t",
    "target_hidden_size": "vLLM update_eagle3 / speculators: fc input = 3 x target_hidden_size",
    "norm_before_residual": "written explicitly: vLLM's speculators path defaults it to TRUE when "
                            "absent, speculators to false",
    "norm_before_fc": "false: no RMSNorm over cat(aux) before fc (speculators field)",
    "fc_norm": "false: no per-aux RMSNorm before fc (speculators field)",
    "norm_output": "false: the un-normed hidden state is fed back (speculators field)",
    "eagle_aux_hidden_state_layer_ids": "vLLM update_eagle3 copies it to the draft config, then "
                                        "get_eagle3_aux_layers_from_config takes it as given "
                                        "(input of layer i); speculators resolves the same "
                                        "[2, L//2, L-3] default when absent",
    "torch_dtype": "dtype of the stored tensors",
    "draftsman": "draftsman's own record (pydantic extra='allow' keeps it; engines ignore it)",
}
KEY_REASONS: dict[str, dict[str, str]] = {"sglang": _FLAT, "vllm": _FLAT, "speculators": _SPECULATORS}
TRANSFORMER_LAYER_REASONS = {"model_type": "'llama': AutoConfig.for_model picks LlamaConfig", **_LLAMA_LAYER}
SPECULATORS_CONFIG_REASONS = {
    "algorithm": "'eagle3'",
    "proposal_methods": "[greedy, speculative_tokens=N]: vLLM requires proposal_methods[0]"
                        "['speculative_tokens']",
    "default_proposal_method": "must name a proposal_type in proposal_methods (speculators validator)",
    "verifier": "name_or_path (vLLM requires the key) and architectures (speculators VerifierConfig)",
}


# ---- RoPE ---------------------------------------------------------------------------------------
def yarn_mscale(factor: float) -> float:
    """vLLM/SGLang yarn_get_mscale: the cos/sin scale their YaRN applies before attn_factor."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_scaling_dict(rope: RopeConfig, max_position_embeddings: int, attention_factor: float) -> dict | None:
    """`rope_scaling` as the engines' get_rope needs it; None for plain RoPE.

    original_max_position_embeddings is always explicit for llama3/yarn: get_rope indexes it
    (KeyError when absent) and pinning it keeps the frequencies fixed if max positions change.
    For yarn, `attn_factor` makes the engines' cos/sin scale (yarn_mscale(factor) * attn_factor)
    equal the attention factor HF and draftsman use (`attention_factor`)."""
    if rope.type == "default":
        return None
    out = rope.to_hf()
    if rope.type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings or max_position_embeddings
    if rope.type == "yarn":
        out["attn_factor"] = attention_factor / yarn_mscale(rope.factor)
        if not rope.truncate:
            out["truncate"] = False
    return out


def rope_keys(rope: RopeConfig, max_position_embeddings: int, attention_factor: float) -> dict[str, Any]:
    """rope_theta + rope_scaling (legacy readers) and rope_parameters (transformers 5), consistent."""
    scaling = rope_scaling_dict(rope, max_position_embeddings, attention_factor)
    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    params["rope_theta"] = rope.theta
    return {"rope_theta": rope.theta, "rope_scaling": scaling, "rope_parameters": params}


# ---- builders -----------------------------------------------------------------------------------
def llama_layer_keys(cfg: DrafterConfig, spec: ExportSpec, attention_factor: float) -> dict[str, Any]:
    """The keys of the single Llama decoder layer, shared by every format."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        **rope_keys(cfg.rope, cfg.max_position_embeddings, attention_factor),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": spec.torch_dtype,
    }


def draftsman_block(cfg: DrafterConfig, spec: ExportSpec, fmt: str) -> dict[str, Any]:
    block: dict[str, Any] = {
        "aux_layer_ids": list(spec.aux_layer_ids),
        "layer_id_convention": "input",
        "exported_for": fmt,
        "drafter_max_position_embeddings": cfg.max_position_embeddings,
    }
    if spec.source_format:
        block["source_format"] = spec.source_format
    return block


def flat_config(cfg: DrafterConfig, spec: ExportSpec, fmt: str, attention_factor: float) -> dict[str, Any]:
    """config.json of the LlamaForCausalLMEagle3 layout SGLang and vLLM both load."""
    ids = list(spec.aux_layer_ids)
    return {
        "architectures": [FLAT_ARCH],
        "model_type": "llama",
        **llama_layer_keys(cfg, spec, attention_factor),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
        "eagle_aux_hidden_state_layer_ids": ids,
        "draftsman": draftsman_block(cfg, spec, fmt),
    }


def speculators_config(cfg: DrafterConfig, spec: ExportSpec, attention_factor: float,
                       speculators_version: str) -> dict[str, Any]:
    """config.json of a `speculators` Eagle3Speculator checkpoint."""
    if spec.verifier_name_or_path is None:
        raise ConfigError("the speculators format names its verifier: pass --target PATH_OR_NAME")
    return {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": speculators_version,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": spec.verifier_name_or_path,
                         "architectures": list(spec.verifier_architectures)},
        },
        "transformer_layer_config": {"model_type": "llama", **llama_layer_keys(cfg, spec, attention_factor)},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "torch_dtype": spec.torch_dtype,
        "draftsman": draftsman_block(cfg, spec, "speculators"),
    }


def export_tensor_name(fmt: str, name: str) -> str:
    """speculators stores the decoder layer as `layers.0.` (vLLM maps `midlayer.` to it too)."""
    if fmt == "speculators" and name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


# ---- import: speculators -> flat ---------------------------------------------------------------
def is_speculators(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw or SPECULATORS_ARCH in (raw.get("architectures") or [])


def speculators_to_flat(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """A speculators Eagle3Speculator config -> the flat layout parse_drafter_config reads,
    and notes on what was assumed."""
    notes: list[str] = []
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigError(f"{source}: field 'speculators_model_type'={kind!r}: only 'eagle3' is supported")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: field 'transformer_layer_config' must be an object")
    for key, what in (("norm_before_fc", "RMSNorm over cat(aux) before fc"),
                      ("fc_norm", "per-aux RMSNorm before fc"),
                      ("norm_output", "normed hidden state fed back")):
        if raw.get(key):
            raise ConfigError(f"{source}: field '{key}'=true ({what}) is not supported")
    flat = {k: v for k, v in _complete_llama_layer(layer, source).items()
            if k not in ("architectures", "model_type")}
    flat["architectures"] = [FLAT_ARCH]
    flat["model_type"] = "llama"
    flat["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = raw["target_hidden_size"]
    if "norm_before_residual" in raw:
        flat["norm_before_residual"] = bool(raw["norm_before_residual"])
    else:
        notes.append("norm_before_residual absent: read as false (speculators' default; vLLM's "
                     "speculators path would assume true)")
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        flat["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    for key in ("torch_dtype", "draftsman"):
        if key in raw and key not in flat:
            flat[key] = raw[key]
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        notes.append(f"speculators verifier: {verifier['name_or_path']}")
    return flat, notes


def _complete_llama_layer(layer: dict[str, Any], source: str) -> dict[str, Any]:
    """speculators stores LlamaConfig.to_diff_dict(): keys equal to LlamaConfig's defaults are
    absent and mean those defaults (e.g. num_hidden_layers 32 is absent only if it IS 32)."""
    from transformers import LlamaConfig

    kind = layer.get("model_type", "llama")
    if kind != "llama":
        raise ConfigError(f"{source}: transformer_layer_config.model_type={kind!r}: only 'llama' drafter "
                          "layers are supported")
    return LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"}).to_dict()


def flat_format(raw: dict[str, Any]) -> str:
    """Which tool wrote a flat LlamaForCausalLMEagle3 config (decides how its ids are read)."""
    if isinstance(raw.get("draftsman"), dict):
        return "draftsman"
    eagle_config = raw.get("eagle_config")
    if isinstance(eagle_config, dict) and eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
        return "sglang"  # SGLang / SpecForge: output-of-layer ids
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        return "vllm"
    return "eagle"  # SafeAILab/EAGLE: no ids, the [2, L//2, L-3] inputs its modeling code captures


def check_reasons(config: dict[str, Any], fmt: str) -> list[str]:
    """Keys of an exported config that have no recorded reason (for tests and the exporter)."""
    missing = [k for k in config if k not in KEY_REASONS[fmt]]
    if fmt == "speculators":
        missing += [f"transformer_layer_config.{k}" for k in config["transformer_layer_config"]
                    if k not in TRANSFORMER_LAYER_REASONS]
        missing += [f"speculators_config.{k}" for k in config["speculators_config"]
                    if k not in SPECULATORS_CONFIG_REASONS]
    return missing


def aux_ids_for(fmt: str, ids: Sequence[int]) -> dict[str, list[int]]:
    """The id lists each key of `fmt` carries, by key path (what the exporter reports)."""
    ids = list(ids)
    if fmt == "speculators":
        return {"eagle_aux_hidden_state_layer_ids": ids}
    return {"eagle_config.eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "eagle_aux_hidden_state_layer_ids": ids}
