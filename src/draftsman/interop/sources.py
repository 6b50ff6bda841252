"""Resolve a drafter path, whatever wrote it, into one flat config and one tensor stream.

Recognised layouts (the format is recorded on the loaded drafter as `source_format`):
  draftsman     config.json with a `draftsman` block (ids in draftsman's input convention)
  sglang        flat LlamaForCausalLMEagle3 with eagle_config ids (SGLang / SpecForge HF export:
                output-of-layer ids, read +1)
  vllm          flat, top-level eagle_aux_hidden_state_layer_ids only (input ids, as given)
  eagle         flat without ids (SafeAILab/EAGLE: its modeling code captures the inputs of
                layers [2, L//2, L-3]); often pytorch_model.bin
  speculators   Eagle3Speculator: transformer_layer_config + speculators_config, `layers.0.` names
  specforge-state  SpecForge's training_state.pt (`draft_state_dict`), as a file, a
                `{run}-stepN/` directory or a run output directory (its `{run}-latest` pointer or
                highest step). Read with torch.load(weights_only=True) only; the drafter config
                comes from `draft_config`, or a config.json beside the state or one level up.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsman.config import ConfigError, read_json
from draftsman.interop.formats import flat_format, is_speculators, speculators_to_flat
from draftsman.weights import CheckpointError, find_checkpoint_files, iter_tensors

STATE_FILE = "training_state.pt"
_STEP_RE = re.compile(r"-step(\d+)$")

TensorStream = Callable[[str], Iterator[tuple[str, Path, Callable[[], Tensor]]]]  # arg: read device


@dataclass
class DrafterSource:
    format: str
    raw_config: dict[str, Any]  # flat LlamaForCausalLMEagle3 layout
    config_path: Path
    tensors: TensorStream  # (name, file, loader) per tensor, names as the checkpoint spells them
    notes: list[str] = field(default_factory=list)


def resolve_drafter_source(path: str | Path, draft_config: str | Path | None = None) -> DrafterSource:
    """Find config and tensors of the drafter at `path` (see the module docstring)."""
    path = Path(path)
    state_file = _find_state_file(path)
    has_weights = path.is_dir() and _has_weights(path)
    if state_file is not None and not has_weights:
        return _specforge_state(state_file, draft_config)
    config_path = Path(draft_config) if draft_config else path / "config.json"
    raw = read_json(config_path)
    notes: list[str] = []
    if is_speculators(raw):
        raw, notes = speculators_to_flat(raw, str(config_path))
        fmt = "speculators"
    else:
        fmt = flat_format(raw)
    ckpt = find_checkpoint_files(path)
    return DrafterSource(fmt, raw, config_path, lambda device="cpu": iter_tensors(ckpt, device), notes)


def _has_weights(d: Path) -> bool:
    try:
        find_checkpoint_files(d)
    except CheckpointError:
        return False
    return True


def _find_state_file(path: Path) -> Path | None:
    """training_state.pt itself, inside `path`, or behind a SpecForge run's pointer/steps."""
    if path.is_file():
        return path if path.name.endswith(".pt") else None
    if not path.is_dir():
        return None
    if (path / STATE_FILE).is_file():
        return path / STATE_FILE
    latest = [p for p in sorted(path.glob("*-latest")) if (p.resolve() / STATE_FILE).is_file()]
    if len(latest) > 1:
        raise CheckpointError(
            f"{path}: holds several SpecForge runs ({[p.name for p in latest]}); pass the "
            "{run_id}-stepN directory you want"
        )
    if latest:
        return latest[0].resolve() / STATE_FILE
    steps = [(int(m.group(1)), p) for p in path.glob("*-step*")
             if (m := _STEP_RE.search(p.name)) and (p / STATE_FILE).is_file()]
    return max(steps)[1] / STATE_FILE if steps else None


def load_state_safely(state_file: Path) -> dict[str, Any]:
    """torch.load(weights_only=True): tensors and plain containers only, never arbitrary objects."""
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(state_file)
        raise CheckpointError(
            f"{state_file}: refusing to unpickle objects beyond tensors"
            + (f" ({', '.join(unsafe)})" if unsafe else "")
            + f"; draftsman reads training states with weights_only=True only ({str(e).splitlines()[0]}). "
            "Older SpecForge checkpoints keep the weights in model.safetensors beside it: point at that "
            "directory instead"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{state_file}: cannot be read as a weights-only torch file ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: expected a dict, got {type(state).__name__}")
    return state


def _unsafe_globals(state_file: Path) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(state_file)))
    except Exception:  # an unreadable archive: the caller's message is enough
        return []


def _specforge_state(state_file: Path, draft_config: str | Path | None) -> DrafterSource:
    state = load_state_safely(state_file)
    weights = state.get("draft_state_dict")
    if not isinstance(weights, dict):
        raise CheckpointError(
            f"{state_file}: no 'draft_state_dict' (keys: {sorted(state)[:10]}); not a SpecForge "
            "training state"
        )
    strategy = state.get("strategy")
    if strategy not in (None, "eagle3"):
        raise CheckpointError(f"{state_file}: SpecForge strategy {strategy!r} is not an EAGLE-3 drafter")
    config_path = _state_config(state_file, draft_config)
    raw = read_json(config_path)
    if is_speculators(raw):
        raise ConfigError(f"{config_path}: a SpecForge state needs its LlamaForCausalLMEagle3 draft config")
    tensors = {k.removeprefix("draft_model."): v for k, v in weights.items() if isinstance(v, Tensor)}

    def stream(device: str = "cpu") -> Iterator[tuple[str, Path, Callable[[], Tensor]]]:
        for name, tensor in tensors.items():
            yield name, state_file, (lambda t=tensor: t)

    step = state.get("global_step")
    notes = [f"SpecForge training state {state_file} (step {step}), config {config_path}"]
    return DrafterSource("specforge-state", raw, config_path, stream, notes)


def _state_config(state_file: Path, draft_config: str | Path | None) -> Path:
    if draft_config:
        return Path(draft_config)
    for d in (state_file.parent, state_file.parent.parent):
        if (d / "config.json").is_file():
            return d / "config.json"
    raise ConfigError(
        f"{state_file}: a SpecForge training state does not carry its draft config; pass "
        "draft_config= (draftsman export --draft-config JSON) or put the draft config json used for "
        f"training (e.g. SpecForge configs/*-eagle3.json) at {state_file.parent / 'config.json'}"
    )
