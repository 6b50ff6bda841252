"""Write a drafter in the layout a serving engine loads as-is: `sglang`, `vllm` (both the flat
LlamaForCausalLMEagle3 layout, aux ids in both conventions) or `speculators` (Eagle3Speculator).
What each key means to each engine: draftsman.interop.formats.KEY_REASONS and docs/deploy.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftsman.config import ConfigError, TargetConfig, parse_target_config, read_json
from draftsman.interop.formats import (
    EXPORT_FORMATS,
    ExportSpec,
    aux_ids_for,
    check_reasons,
    export_tensor_name,
    flat_config,
    speculators_config,
)
from draftsman.models.eagle3 import Eagle3Drafter
from draftsman.models.layers import rope_inv_freq
from draftsman.weights import save_safetensors

# The speculators release whose config classes the exported layout is validated against (tests).
SPECULATORS_VERSION = "0.9.0"


@dataclass(frozen=True)
class TargetRef:
    """--target: a local checkpoint directory (config read) or a hub name (recorded only)."""

    name_or_path: str
    config: TargetConfig | None = None
    architectures: tuple[str, ...] = ()


@dataclass
class ExportResult:
    out: Path
    format: str
    config: dict[str, Any]
    aux_layer_ids: dict[str, list[int]]  # key path -> ids as written
    tensors: list[str]
    notes: list[str] = field(default_factory=list)


def resolve_target(name_or_path: str | None) -> TargetRef | None:
    """The name as given (what a speculators export records) and, where it can be read, the
    target's config: a directory's, a .gguf file's (converted), or a hub id's config.json."""
    from draftsman.target_source import (
        TargetSourceError,
        cached_gguf_checkpoint,
        hub_snapshot,
        is_gguf,
        is_hub_id,
    )

    if name_or_path is None:
        return None
    folder = Path(name_or_path)
    if is_gguf(name_or_path):
        folder = cached_gguf_checkpoint(folder)
    elif is_hub_id(name_or_path):
        try:
            folder = hub_snapshot(name_or_path, patterns=["config.json"])
        except TargetSourceError:  # offline: the name is recorded, the drafter is not checked
            return TargetRef(name_or_path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return TargetRef(name_or_path)
    raw = read_json(cfg_file)
    return TargetRef(name_or_path, parse_target_config(raw, str(cfg_file)), tuple(raw.get("architectures") or ()))


def check_against_target(drafter: Eagle3Drafter, target: TargetConfig, ids: tuple[int, ...]) -> None:
    cfg, errors = drafter.config, []
    if cfg.vocab_size != target.vocab_size:
        errors.append(f"drafter vocab_size={cfg.vocab_size}, target vocab_size={target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        errors.append(f"drafter target_hidden_size={cfg.target_hidden_size}, target hidden_size={target.hidden_size}")
    bad = [i for i in ids if not 0 <= i <= target.num_hidden_layers]
    if bad:
        errors.append(f"aux layer ids {list(ids)} include {bad}, outside 0..{target.num_hidden_layers}")
    if errors:
        raise ConfigError("the drafter does not fit --target: " + "; ".join(errors))


def export_spec(drafter: Eagle3Drafter, fmt: str, target: TargetRef | None, dtype: torch.dtype,
                speculative_tokens: int) -> tuple[ExportSpec, list[str]]:
    """Everything the writers need, with notes on what was decided and why."""
    cfg, notes = drafter.config, []
    ids = drafter.aux_layer_ids
    if ids is None:
        if target is None or target.config is None:
            raise ConfigError(
                "the drafter does not record its aux layer ids (it relies on the target default); pass "
                "--target with the target's checkpoint directory so they are written explicitly"
            )
        ids = tuple(target.config.default_aux_layer_ids())
        notes.append(f"aux layer ids: target default [2, L//2, L-3] = {list(ids)}")
    max_pos = cfg.max_position_embeddings
    if target is not None and target.config is not None:
        check_against_target(drafter, target.config, tuple(ids))
        if target.config.max_position_embeddings > max_pos:
            # SGLang refuses a draft shorter than the target's context, vLLM caps the draft window
            # (speculators' converter takes the max too); the RoPE frequencies stay pinned.
            notes.append(f"max_position_embeddings {max_pos} -> {target.config.max_position_embeddings} "
                         "(the target's window; rotary frequencies unchanged)")
            max_pos = target.config.max_position_embeddings
    if fmt == "sglang" and drafter.has_own_embedding:
        raise ConfigError(
            f"the drafter is narrower than its target (hidden {cfg.hidden_size} vs {cfg.target_hidden_size}) "
            "and carries its own embedding, but SGLang's EAGLE-3 worker always installs the target's "
            "embedding: export --to vllm or speculators instead"
        )
    spec = ExportSpec(
        aux_layer_ids=tuple(ids),
        torch_dtype=str(dtype).removeprefix("torch."),
        max_position_embeddings=max_pos,
        own_embedding=drafter.has_own_embedding,
        verifier_name_or_path=target.name_or_path if target else None,
        verifier_architectures=target.architectures if target else (),
        speculative_tokens=speculative_tokens,
        source_format=getattr(drafter, "source_format", None),
    )
    return spec, notes


def build_export_config(drafter: Eagle3Drafter, fmt: str, spec: ExportSpec) -> dict[str, Any]:
    cfg = drafter.config
    attention_factor = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)[1]
    if fmt == "speculators":
        config = speculators_config(cfg, spec, attention_factor, SPECULATORS_VERSION)
    else:
        config = flat_config(cfg, spec, fmt, attention_factor)
    unexplained = check_reasons(config, fmt)
    if unexplained:  # formats.py invariant: every key says which engine reads it and why
        raise RuntimeError(f"keys written without a recorded reason: {unexplained}")
    return config


def export_tensors(drafter: Eagle3Drafter, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """State dict under the format's names; floating tensors in `dtype`, d2t int64, t2d bool."""
    out = {}
    for name, t in drafter.state_dict().items():
        out[export_tensor_name(fmt, name)] = t.to(dtype) if t.is_floating_point() else t
    return out


def export_drafter(drafter: Eagle3Drafter, fmt: str, out_dir: str | Path, target: TargetRef | None = None,
                   dtype: torch.dtype | None = None, speculative_tokens: int = 3) -> ExportResult:
    """Write config.json + model.safetensors for `fmt` into out_dir."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (one of {list(EXPORT_FORMATS)})")
    dtype = dtype or drafter.fc.weight.dtype
    spec, notes = export_spec(drafter, fmt, target, dtype, speculative_tokens)
    config = build_export_config(drafter, fmt, spec)
    tensors = export_tensors(drafter, fmt, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out / "model.safetensors")
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(out / "config.json")
    return ExportResult(out, fmt, config, aux_ids_for(fmt, spec.aux_layer_ids), sorted(tensors), notes)
