"""Hugging Face `config.json` -> frozen dataclasses, validated once at the boundary."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LLAMA_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DEEPSEEK_ARCHS = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "KimiK2ForCausalLM": "kimi_k2",
}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v3", "kimi_k2")
# Multimodal wrappers whose text backbone is a DeepSeek-V3 (Kimi-K2.5): tensors under this prefix.
WRAPPED_TEXT_PREFIX = "language_model."


class ConfigError(ValueError):
    """A config.json that draftsman cannot use; the message names the file and field."""


class UnsupportedModelError(ConfigError):
    """The checkpoint's architecture is not one draftsman implements."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings, whichever spelling the checkpoint used."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims

    def to_hf(self) -> dict[str, Any]:
        """The `rope_scaling` dict of published checkpoints (None-valued keys dropped)."""
        out: dict[str, Any] = {"rope_type": self.type}
        if self.type == "default":
            return out
        out["factor"] = self.factor
        if self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.type == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.type == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3 mixture of experts: sigmoid scores, group-limited routing, shared experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "sigmoid"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


@dataclass(frozen=True)
class TargetConfig:
    """What a target model needs, parsed from an HF config.json."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # llama | mistral | qwen2 | qwen3 | deepseek_v3 | kimi_k2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    weight_prefix: str = ""  # e.g. "language_model." for Kimi-K2.5's text backbone
    num_nextn_predict_layers: int = 0  # DeepSeek-V3 MTP layers stored after the last layer
    torch_dtype: str | None = None

    @property
    def family(self) -> str:
        return "deepseek" if self.mla is not None else "llama"

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """EAGLE-3's default capture points: residual entering layers 2, L//2, L-3."""
        n = self.num_hidden_layers
        return (2, n // 2, n - 3) if n >= 4 else (0, n // 2, n - 1)


def _require(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return raw[key]


def parse_rope(raw: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """Read RoPE from `rope_theta` + `rope_scaling` (published checkpoints) or `rope_parameters`
    (transformers >= 5)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type spelling
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(raw.get("rope_scaling") or {})
    theta = float(scaling.pop("rope_theta", raw.get("rope_theta", 10000.0)) or 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ConfigError(
            f"{source}: unsupported rope type '{rope_type}' (supported: default, linear, llama3, yarn)"
        )
    known = {f for f in RopeConfig.__dataclass_fields__ if f not in ("theta", "type")}
    kwargs = {k: v for k, v in scaling.items() if k in known and v is not None}
    if rope_type != "default" and "factor" not in kwargs:
        raise ConfigError(f"{source}: rope type '{rope_type}' needs a 'factor'")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if key in kwargs:
            kwargs[key] = float(kwargs[key])
    return RopeConfig(theta=theta, type=rope_type, **kwargs)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _resolve_family(raw: dict[str, Any], source: str) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    for arch in archs:
        if arch in LLAMA_ARCHS:
            return arch, LLAMA_ARCHS[arch]
        if arch in DEEPSEEK_ARCHS:
            return arch, model_type if model_type in ("deepseek_v3", "kimi_k2") else "deepseek_v3"
    if model_type in SUPPORTED_MODEL_TYPES:
        default_arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }.get(model_type, "DeepseekV3ForCausalLM")
        return default_arch, model_type
    supported = sorted(LLAMA_ARCHS) + sorted(DEEPSEEK_ARCHS)
    raise UnsupportedModelError(
        f"{source}: unsupported model (architectures={archs}, model_type={model_type!r}); "
        f"draftsman supports architectures {supported} "
        f"(model_type one of {list(SUPPORTED_MODEL_TYPES)})"
    )


def _unwrap_text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Kimi-K2.5 and similar wrappers keep the DeepSeek-V3 text model under `text_config`."""
    text = raw.get("text_config")
    if isinstance(text, dict) and text.get("model_type") in ("deepseek_v3", "kimi_k2"):
        merged = dict(text)
        for key in ("eos_token_id", "bos_token_id", "torch_dtype"):
            merged.setdefault(key, raw.get(key))
        merged.setdefault("architectures", ["DeepseekV3ForCausalLM"])
        return merged, WRAPPED_TEXT_PREFIX
    return raw, ""


def parse_target_config(raw: dict[str, Any], source: str = "config.json") -> TargetConfig:
    """Parse a raw HF config dict into a TargetConfig, raising ConfigError naming the field."""
    raw, prefix = _unwrap_text_config(raw)
    arch, model_type = _resolve_family(raw, source)
    hidden = int(_require(raw, "hidden_size", source))
    heads = int(_require(raw, "num_attention_heads", source))
    common: dict[str, Any] = dict(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        num_hidden_layers=int(_require(raw, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope=parse_rope(raw, source),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        weight_prefix=prefix,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )
    if model_type in ("deepseek_v3", "kimi_k2"):
        return _deepseek_config(raw, common, source)
    if common["num_attention_heads"] % common["num_key_value_heads"]:
        raise ConfigError(
            f"{source}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={common['num_key_value_heads']}"
        )
    return TargetConfig(
        **common,
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
    )


def _deepseek_config(raw: dict[str, Any], common: dict[str, Any], source: str) -> TargetConfig:
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(_require(raw, "kv_lora_rank", source)),
        qk_nope_head_dim=int(_require(raw, "qk_nope_head_dim", source)),
        qk_rope_head_dim=int(_require(raw, "qk_rope_head_dim", source)),
        v_head_dim=int(_require(raw, "v_head_dim", source)),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    moe = None
    if raw.get("n_routed_experts"):
        scoring = raw.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ConfigError(f"{source}: scoring_func '{scoring}' is not supported (only 'sigmoid')")
        moe = MoEConfig(
            n_routed_experts=int(raw["n_routed_experts"]),
            num_experts_per_tok=int(_require(raw, "num_experts_per_tok", source)),
            moe_intermediate_size=int(_require(raw, "moe_intermediate_size", source)),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            scoring_func=scoring,
        )
        if moe.n_routed_experts % moe.n_group:
            raise ConfigError(
                f"{source}: n_routed_experts={moe.n_routed_experts} is not divisible by n_group={moe.n_group}"
            )
    common["head_dim"] = mla.qk_rope_head_dim  # the rotary dimension of MLA
    return TargetConfig(
        **common,
        attention_bias=bool(raw.get("attention_bias", False)),
        mla=mla,
        moe=moe,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON file, with errors that name it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def load_target_config(model_dir: str | Path) -> TargetConfig:
    path = Path(model_dir) / "config.json"
    return parse_target_config(read_json(path), source=str(path))


# ---- EAGLE-3 drafter --------------------------------------------------------------------------

# Architecture names that the engines load as the same single-layer Llama EAGLE-3 drafter
# (SGLang: LlamaForCausalLMEagle3; vLLM registers both names to llama_eagle3.Eagle3LlamaForCausalLM).
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Known drafter architectures that are NOT this format, with the reason given to the user.
OTHER_DRAFTER_ARCHS = {
    "LlamaForCausalLMEagle": "an EAGLE-1/2 drafter (SGLang llama_eagle.py), not EAGLE-3",
    "EagleLlamaForCausalLM": "an EAGLE-1/2 drafter (vLLM llama_eagle.py), not EAGLE-3",
    "Eagle3Speculator": "a `speculators` EAGLE-3 checkpoint (transformer_layer_config + "
    "speculators_config); convert it to the HF LlamaForCausalLMEagle3 layout first",
}
# Aux-layer-id conventions. "input": id i = residual stream entering target layer i
# (= HF output_hidden_states[i]; draftsman, SafeAILab/EAGLE, vLLM). "output": id i = output of
# target layer i (SpecForge writes these, SGLang's set_eagle3_layers_to_capture adds +1).
LAYER_ID_CONVENTIONS = {
    "input": "input",
    "draftsman": "input",
    "vllm": "input",
    "eagle": "input",
    "output": "output",
    "sglang": "output",
    "specforge": "output",
}


@dataclass(frozen=True)
class DrafterConfig:
    """An EAGLE-3 drafter checkpoint's config.json, with aux layer ids in draftsman's convention."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # rows of lm_head (== vocab_size when absent)
    target_hidden_size: int  # width of each aux hidden state (== hidden_size when absent)
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Residual stream ENTERING target layer i (HF output_hidden_states[i]); None = target default.
    aux_layer_ids: tuple[int, ...] | None = None
    layer_ids_source: str = "default: [2, L//2, L-3] from the target"
    # The ids exactly as the file spelled them, and how they were read ("input" / "output").
    raw_aux_layer_ids: tuple[int, ...] | None = None
    layer_id_convention: str | None = None
    # vLLM/speculators option: the residual around attention is hidden_norm(h) instead of h.
    norm_before_residual: bool = False
    torch_dtype: str | None = None

    @property
    def fc_in_features(self) -> int:
        return 3 * self.target_hidden_size

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.vocab_size


def _int_ids(value: Any, source: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ConfigError(f"{source}: field '{key}' must be a list of integers, got {value!r}")
    if len(value) != 3:
        raise ConfigError(
            f"{source}: field '{key}' must list exactly 3 layer ids (EAGLE-3's fc reads 3 aux "
            f"hidden states), got {list(value)}"
        )
    return tuple(int(i) for i in value)


def _resolve_aux_ids(
    raw: dict[str, Any], source: str, layer_id_convention: str | None
) -> tuple[tuple[int, ...] | None, str, tuple[int, ...] | None, str | None]:
    """(ids in draftsman's input convention, description, ids as written, convention used)."""
    if layer_id_convention is not None and layer_id_convention not in LAYER_ID_CONVENTIONS:
        raise ConfigError(
            f"layer_id_convention={layer_id_convention!r} is not one of {sorted(LAYER_ID_CONVENTIONS)}"
        )
    forced = LAYER_ID_CONVENTIONS.get(layer_id_convention) if layer_id_convention else None
    eagle_config = raw.get("eagle_config")
    if eagle_config is not None and not isinstance(eagle_config, dict):
        raise ConfigError(f"{source}: field 'eagle_config' must be an object, got {eagle_config!r}")
    eagle_config = eagle_config or {}
    nested_key, top_key = "eagle_config.eagle_aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids"
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = _int_ids(nested, source, nested_key) if nested is not None else None
    top = _int_ids(top, source, top_key) if top is not None else None

    block = raw.get("draftsman")
    if isinstance(block, dict) and block.get("aux_layer_ids") is not None:
        ids = _int_ids(block["aux_layer_ids"], source, "draftsman.aux_layer_ids")
        convention = block.get("layer_id_convention", "input")
        if convention != "input":
            raise ConfigError(
                f"{source}: field 'draftsman.layer_id_convention' must be 'input', got {convention!r}"
            )
        # draftsman writes all three spellings consistently; a disagreement means a hand edit.
        if nested is not None and tuple(i + 1 for i in nested) != ids:
            raise ConfigError(
                f"{source}: draftsman.aux_layer_ids={list(ids)} (input of layer i) disagrees with "
                f"{nested_key}={list(nested)} (output of layer i, expected {[i - 1 for i in ids]}); "
                "fix one of them or delete the 'draftsman' block"
            )
        if top is not None and top != ids:
            raise ConfigError(
                f"{source}: draftsman.aux_layer_ids={list(ids)} disagrees with top-level "
                f"{top_key}={list(top)} (vLLM reads it as input-of-layer ids, expected {list(ids)})"
            )
        return ids, f"{source}: draftsman.aux_layer_ids (input of layer i)", ids, "input"

    if nested is not None:
        key, written, convention = nested_key, nested, forced or "output"
    elif top is not None:
        # Only vLLM reads the top-level key, as input-of-layer ids (speculators writes it so too).
        key, written, convention = top_key, top, forced or "input"
    else:
        return None, "default: [2, L//2, L-3] from the target", None, None
    ids = tuple(i + 1 for i in written) if convention == "output" else written
    how = "output of layer i, +1" if convention == "output" else "input of layer i, as given"
    why = "caller's layer_id_convention" if forced else (
        "SGLang/SpecForge convention" if convention == "output" else "vLLM convention"
    )
    desc = f"{source}: {key}={list(written)} read as {how} ({why})"
    if key == nested_key and top is not None and top != ids:
        desc += f"; note: vLLM would capture the input of layers {list(top)} (top-level {top_key})"
    if min(ids) < 0:
        raise ConfigError(f"{source}: field '{key}'={list(written)} gives negative layer ids {list(ids)}")
    return ids, desc, written, convention


def parse_drafter_config(
    raw: dict[str, Any], source: str = "config.json", layer_id_convention: str | None = None
) -> DrafterConfig:
    """Parse an EAGLE-3 drafter config.json (SpecForge / SafeAILab / SGLang / vLLM layout).

    Aux layer ids: a `draftsman` block wins; else `eagle_config.eagle_aux_hidden_state_layer_ids`
    is read as SGLang/SpecForge "output of layer i" ids (+1), and a top-level
    `eagle_aux_hidden_state_layer_ids` as vLLM "input of layer i" ids, unless `layer_id_convention`
    ("sglang"/"output" or "vllm"/"input") says otherwise; else None (target default)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: field 'architectures' must be a list, got {archs!r}")
    arch = next((a for a in archs if a in EAGLE3_ARCHS), None)
    if arch is None:
        known = [f"{a} is {OTHER_DRAFTER_ARCHS[a]}" for a in archs if a in OTHER_DRAFTER_ARCHS]
        raise UnsupportedModelError(
            f"{source}: field 'architectures'={archs} is not an EAGLE-3 drafter "
            f"(expected one of {list(EAGLE3_ARCHS)})" + (f": {'; '.join(known)}" if known else "")
        )
    layers = int(raw.get("num_hidden_layers") or 1)
    if layers != 1:
        raise ConfigError(f"{source}: field 'num_hidden_layers'={layers}: only single-layer EAGLE-3 drafters are supported")
    unsupported = {
        "fc_norm": (True, "per-aux RMSNorm before fc (SpecForge 'eagle3.1')"),
        "norm_output": (False, "logits without the final norm"),
        "attention_bias": (True, "q/k/v/o biases"),
        "mlp_bias": (True, "MLP biases"),
    }
    for key, (bad, what) in unsupported.items():
        if bool(raw.get(key, not bad)) == bad:
            raise ConfigError(f"{source}: field '{key}'={raw[key]!r} ({what}) is not supported")
    eagle_config = raw.get("eagle_config")
    if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state") is False:
        raise ConfigError(
            f"{source}: field 'eagle_config.use_aux_hidden_state'=false (a drafter without fc over aux "
            "hidden states) is not supported"
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{source}: field 'hidden_act'={act!r} is not supported (only 'silu')")

    hidden = int(_require(raw, "hidden_size", source))
    heads = int(_require(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    vocab = int(_require(raw, "vocab_size", source))
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"{source}: field 'draft_vocab_size'={draft_vocab} must be in 1..vocab_size={vocab}")
    ids, ids_source, written, convention = _resolve_aux_ids(raw, source, layer_id_convention)
    return DrafterConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=parse_rope(raw, source),
        aux_layer_ids=ids,
        layer_ids_source=ids_source,
        raw_aux_layer_ids=written,
        layer_id_convention=convention,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def load_drafter_config(model_dir: str | Path, layer_id_convention: str | None = None) -> DrafterConfig:
    path = Path(model_dir) / "config.json"
    return parse_drafter_config(read_json(path), source=str(path), layer_id_convention=layer_id_convention)
