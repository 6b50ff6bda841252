"""Load a drafter the way doctor needs it: keep going past the faults `load_drafter` rightly refuses
(an inconsistent t2d, a d2t that maps outside the vocabulary, out-of-range layer ids), record the
tensors exactly as stored, and say what can still be measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsman.config import ConfigError, DrafterConfig, parse_drafter_config, read_json
from draftsman.doctor.checks import mapped_ids, valid_mapping
from draftsman.models.eagle3 import EMBED_NAMES, Eagle3Drafter
from draftsman.weights import CheckpointError, build_empty, find_checkpoint_files, iter_tensors


@dataclass
class LoadedDrafter:
    path: str
    raw_config: dict[str, Any] = field(default_factory=dict)
    config: DrafterConfig | None = None
    drafter: Eagle3Drafter | None = None  # None: nothing can be run (see errors)
    d2t: Tensor | None = None  # as stored in the checkpoint (None: absent)
    t2d: Tensor | None = None
    fc_in: int | None = None
    lm_head_rows: int | None = None
    errors: list[str] = field(default_factory=list)  # why the drafter cannot run
    notes: list[str] = field(default_factory=list)
    bound: bool = False  # bound to the target: the engine can run it

    @property
    def own_embedding(self) -> bool:
        return self.config is not None and self.config.hidden_size != self.config.target_hidden_size


def _param_name(name: str) -> str | None:
    """Checkpoint tensor name -> drafter state name (None: not a drafter tensor to load)."""
    if name in EMBED_NAMES:
        return "embed_tokens.weight"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith("layers.0."):  # speculators / vLLM-internal spelling of `midlayer.`
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def read_tensors(path: Path) -> dict[str, Tensor]:
    return {name: load() for name, _, load in iter_tensors(find_checkpoint_files(path), "cpu")}


def load_lenient(path: str | Path, target, device: torch.device, dtype: torch.dtype) -> LoadedDrafter:
    path = Path(path)
    out = LoadedDrafter(str(path))
    try:
        out.raw_config = read_json(path / "config.json")
        out.config = parse_drafter_config(out.raw_config, str(path / "config.json"))
        tensors = read_tensors(path)
    except (ConfigError, CheckpointError) as e:
        out.errors.append(str(e))
        return out
    cfg, tcfg = out.config, target.config
    out.d2t, out.t2d = tensors.get("d2t"), tensors.get("t2d")
    fc = tensors.get("fc.weight")
    out.fc_in = int(fc.shape[1]) if fc is not None and fc.dim() == 2 else None
    head = tensors.get("lm_head.weight")
    out.lm_head_rows = int(head.shape[0]) if head is not None else None
    if cfg.target_hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size or (
            not out.own_embedding and cfg.hidden_size != tcfg.hidden_size):
        out.errors.append("the drafter's sizes do not fit the target (see hidden sizes / vocab)")
        return out
    drafter = build_empty(lambda: Eagle3Drafter(cfg, out.own_embedding), device, dtype)
    state = drafter.state_dict()
    loaded = set()
    with torch.no_grad():
        for name, tensor in tensors.items():
            pname = _param_name(name)
            if pname == "embed_tokens.weight" and not out.own_embedding:
                continue  # the target's embedding is used (as engines do)
            if pname not in state or tuple(state[pname].shape) != tuple(tensor.shape):
                shape = None if pname not in state else list(state[pname].shape)
                out.errors.append(f"tensor '{name}' {list(tensor.shape)} does not fit the drafter (expects {shape})")
                continue
            state[pname].copy_(tensor.to(state[pname].dtype))
            loaded.add(pname)
    _fill_mapping(out, drafter, loaded, target)
    missing = sorted(set(state) - loaded - {"t2d"})
    if missing:
        out.errors.append(f"missing tensors: {missing}")
    if out.errors:
        return out
    drafter.aux_layer_ids = cfg.aux_layer_ids or tuple(tcfg.default_aux_layer_ids())
    out.drafter = drafter.eval()
    _bind(out, target)
    return out


def _fill_mapping(out: LoadedDrafter, drafter: Eagle3Drafter, loaded: set[str], target) -> None:
    """d2t as stored (or what engines fall back to), and a t2d derived from it so the engine runs."""
    cfg = out.config
    with torch.no_grad():
        if "d2t" not in loaded:
            t2d = out.t2d
            if t2d is not None and t2d.numel() == cfg.vocab_size and int(t2d.sum()) == cfg.draft_vocab_size:
                ids = t2d.bool().nonzero().flatten()
                drafter.d2t.copy_(ids - torch.arange(ids.numel()))
                out.notes.append("d2t absent: rebuilt from t2d (ascending target ids)")
            elif cfg.full_vocab:
                drafter.d2t.zero_()
                out.notes.append("d2t absent: identity over the full vocabulary")
            else:
                out.errors.append("d2t absent with a reduced draft vocabulary and no usable t2d")
                return
            loaded.add("d2t")
        if "lm_head.weight" not in loaded and cfg.full_vocab \
                and tuple(target.lm_head.weight.shape) == tuple(drafter.lm_head.weight.shape):
            drafter.lm_head.weight.copy_(target.lm_head.weight)  # what SGLang does
            loaded.add("lm_head.weight")
            out.notes.append("lm_head absent: the target's lm_head is used (full vocabulary)")
        ids = mapped_ids(drafter.d2t)
        inside = ids[(ids >= 0) & (ids < cfg.vocab_size)]
        drafter.t2d.zero_()
        drafter.t2d[inside] = True


def _bind(out: LoadedDrafter, target) -> None:
    """Bind for the engine only when d2t is a valid mapping and the layer ids exist; otherwise the
    drafter can still be scored (teacher forcing does not index the embedding with draft ids)."""
    d = out.drafter
    if not valid_mapping(mapped_ids(d.d2t), out.config.vocab_size):
        out.notes.append("the engine cannot run this drafter: d2t maps outside the vocabulary or not one-to-one")
        return
    try:
        d.bind_target(target)
    except ValueError as e:
        out.notes.append(f"the engine cannot run this drafter: {e}")
        return
    out.bound = True
