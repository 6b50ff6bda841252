"""INT4 weights in the compressed-tensors `pack-quantized` format Kimi-K2-Thinking / Kimi-K2.5
ship: symmetric int4, one scale per group of 32 input columns, no zero point, weight-only.

Per quantized Linear `X` the checkpoint stores
  X.weight_packed  int32 [out, ceil(in / 8)]   eight 4-bit values per word, value i at bits 4i..4i+3,
                                                each stored as q + 8 (so q = nibble - 8, in [-8, 7])
  X.weight_scale   float [out, in / group_size] (bf16 in the Kimi checkpoints)
  X.weight_shape   int   [2] = (out, in)
and W = q * scale (scale repeated over its group). `quantization_config` (top level, or inside
`text_config` for Kimi-K2.5) names the scheme and an `ignore` list of module names kept in full
precision ("lm_head", "re:.*self_attn.*", ...; "re:" patterns use re.match, others equality, as
compressed-tensors' match_name does). Modules stay packed in memory and are dequantized one at a
time as they compute (a Linear per forward, a routed expert per use), so a target keeps its INT4
footprint on the GPUs and computes what a dequantized copy computes.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsman.config import ConfigError, read_json
from draftsman.weights import SKIP, CheckpointError, find_checkpoint_files, iter_tensors

PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")
PACK_FACTOR = 8  # int4 values per int32 word


# ---- config -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackQuantConfig:
    group_size: int
    ignore: tuple[str, ...] = ()
    num_bits: int = 4


def parse_quant_config(raw: dict[str, Any], source: str = "config.json") -> PackQuantConfig | None:
    """The pack-quantized scheme of an HF config.json; None when the checkpoint is not quantized.
    Anything else compressed-tensors can describe is refused by name."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")  # Kimi-K2.5
    if qc is None:
        return None
    where = f"{source}: quantization_config"

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"{where}: {what} (supported: compressed-tensors pack-quantized, symmetric int4 "
                              "weights in groups, weight-only)")

    need(qc.get("quant_method") == "compressed-tensors", f"quant_method={qc.get('quant_method')!r}")
    need(qc.get("format") == "pack-quantized", f"format={qc.get('format')!r}")
    need(qc.get("quantization_status", "compressed") == "compressed",
         f"quantization_status={qc.get('quantization_status')!r}")
    need(qc.get("kv_cache_scheme") is None, "kv_cache_scheme is set")
    groups = qc.get("config_groups") or {}
    need(len(groups) == 1, f"{len(groups)} config_groups")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    need(group.get("format", "pack-quantized") == "pack-quantized", f"{name}.format={group.get('format')!r}")
    need(list(group.get("targets") or ["Linear"]) == ["Linear"], f"{name}.targets={group.get('targets')}")
    need(group.get("input_activations") is None and group.get("output_activations") is None,
         f"{name} quantizes activations")
    need(w.get("num_bits") == 4 and w.get("type", "int") == "int", f"{name}.weights num_bits={w.get('num_bits')} "
         f"type={w.get('type')!r}")
    need(w.get("symmetric") is True, f"{name}.weights symmetric={w.get('symmetric')}")
    need(w.get("strategy") == "group" and isinstance(w.get("group_size"), int) and w["group_size"] > 0,
         f"{name}.weights strategy={w.get('strategy')!r} group_size={w.get('group_size')}")
    need(not w.get("actorder") and not w.get("dynamic"), f"{name}.weights actorder/dynamic set")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ConfigError(f"{where}: 'ignore' must be a list of strings, got {ignore!r}")
    for p in ignore:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise ConfigError(f"{where}: ignore pattern {p!r} is not a valid regex ({e})") from None
    return PackQuantConfig(group_size=int(w["group_size"]), ignore=tuple(ignore))


def read_quant_config(model_dir: str | Path) -> PackQuantConfig | None:
    path = Path(model_dir) / "config.json"
    return parse_quant_config(read_json(path), str(path))


def is_ignored(module_name: str, ignore: Iterable[str]) -> bool:
    """compressed-tensors match_name: "re:" + regex with re.match, else the exact name."""
    return any(re.match(p[3:], module_name) is not None if p.startswith("re:") else p == module_name
               for p in ignore)


# ---- packing ------------------------------------------------------------------------------------
def pack_int4(q: Tensor) -> Tensor:
    """int values in [-8, 7] [..., n] -> int32 [..., ceil(n / 8)] (the checkpoint layout)."""
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    n = q.shape[-1]
    u = (q.to(torch.int64) + 8)
    u = F.pad(u, (0, -n % PACK_FACTOR))
    u = u.view(*u.shape[:-1], -1, PACK_FACTOR)
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64, device=q.device) * 4
    words = (u << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement


def unpack_int4(packed: Tensor, cols: int) -> Tensor:
    """int32 [..., w] -> int8 [..., cols] values in [-8, 7]."""
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32, device=packed.device) * 4
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift, then mask: sign bits drop out
    return (nibbles.reshape(*packed.shape[:-1], -1)[..., :cols] - 8).to(torch.int8)


def dequantize(packed: Tensor, scale: Tensor, cols: int, group_size: int, dtype: torch.dtype) -> Tensor:
    """W = q * scale, computed in fp32 (exact: a 4-bit integer times the scale) and rounded once
    to `dtype`, which is what compressed-tensors' q.to(scale.dtype) * scale gives."""
    q = unpack_int4(packed, cols).to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=-1)[..., :cols]
    return (q * s).to(dtype)


def quantize_int4(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Symmetric group-wise int4 (compressed-tensors' minmax observer: scale = absmax / 7.5,
    q = clamp(round(w / scale), -8, 7)). Returns (q int8, scale in w's dtype). For tests/tools."""
    out, cols = w.shape[-2], w.shape[-1]
    g = w.float().reshape(*w.shape[:-1], -1, group_size)
    scale = (g.abs().amax(-1) / 7.5).clamp_min(1e-12).to(w.dtype)
    q = (g / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int8)
    return q.reshape(*w.shape[:-2], out, cols), scale


# ---- modules ------------------------------------------------------------------------------------
def _packed_buffers(module: nn.Module, prefix: str, lead: tuple[int, ...], out: int, cols: int,
                    group_size: int) -> None:
    words, groups = -(-cols // PACK_FACTOR), -(-cols // group_size)
    module.register_buffer(f"{prefix}packed", torch.empty(*lead, out, words, dtype=torch.int32))
    module.register_buffer(f"{prefix}scale", torch.empty(*lead, out, groups))  # the model dtype
    module.register_buffer(f"{prefix}shape", torch.empty(*lead, 2, dtype=torch.int64))


class PackedInt4Linear(nn.Module):
    """nn.Linear whose weight stays packed; `weight` dequantizes on access (MLA's absorbed
    attention reads kv_b_proj.weight directly)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        _packed_buffers(self, "weight_", (), out_features, in_features, group_size)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def weight(self) -> Tensor:
        return dequantize(self.weight_packed, self.weight_scale, self.in_features, self.group_size,
                          self.weight_scale.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    def expected_shape(self) -> list[int]:
        return [self.out_features, self.in_features]


class _PackedStack:
    """Reads like a stacked expert parameter [E, out, in]: indexing dequantizes one expert."""

    def __init__(self, owner: nn.Module, name: str) -> None:
        self.owner, self.name = owner, name
        packed = getattr(owner, f"{name}_packed")
        self.cols = owner.dims[name][1]
        self.shape = torch.Size((packed.shape[0], packed.shape[1], self.cols))

    def __getitem__(self, expert: int) -> Tensor:
        o = self.owner
        scale = getattr(o, f"{self.name}_scale")[expert]
        return dequantize(getattr(o, f"{self.name}_packed")[expert], scale, self.cols, o.group_size, scale.dtype)


@functools.cache
def packed_experts_class(base: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the family's routed-experts module whose stacked gate/up/down weights stay
    packed; the family's own forward runs unchanged and dequantizes an expert when it uses it."""

    class PackedExperts(base):  # type: ignore[misc, valid-type]
        def __init__(self, n_experts: int, hidden: int, inner: int, group_size: int) -> None:
            nn.Module.__init__(self)  # not base.__init__: that would allocate the full weights
            self.group_size = group_size
            self.dims = {"gate_proj": (inner, hidden), "up_proj": (inner, hidden), "down_proj": (hidden, inner)}
            for name, (out, cols) in self.dims.items():
                _packed_buffers(self, f"{name}_", (n_experts,), out, cols, group_size)

        gate_proj = property(lambda self: _PackedStack(self, "gate_proj"))
        up_proj = property(lambda self: _PackedStack(self, "up_proj"))
        down_proj = property(lambda self: _PackedStack(self, "down_proj"))

        def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
            # Expert by expert: only the routed experts are dequantized.
            return self.grouped(x, weights, ids)

    PackedExperts.__name__ = PackedExperts.__qualname__ = f"Packed{base.__name__}"
    return PackedExperts


# ---- which modules are packed -----------------------------------------------------------------
@dataclass(frozen=True)
class PackPlan:
    linears: frozenset[str]  # model module names of packed nn.Linear
    experts: frozenset[str]  # model module names of stacked routed experts, all packed


def hf_module_name(name: str, prefix: str = "") -> str:
    """draftsman module name -> the checkpoint's (HF) module name the ignore list is written for."""
    return prefix + (name if name == "lm_head" else f"model.{name}")


def _stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Routed-expert modules: their gate/up/down are parameters stacked over experts."""
    stacked = getattr(model, "stacked_params", {})
    return {name.rsplit(".", 1)[0]: model.get_submodule(name.rsplit(".", 1)[0]) for name in stacked}


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    return [name for name, _, _ in iter_tensors(find_checkpoint_files(d))]


def plan_packing(model: nn.Module, names: Iterable[str], qcfg: PackQuantConfig,
                 resolve: Callable[[str], Any], prefix: str = "") -> PackPlan:
    """Match the checkpoint's packed tensors to the model's modules and check them against the
    config: a module the ignore list keeps in full precision must not be packed, and every other
    Linear (and every routed expert) must be. `resolve` maps a checkpoint name to
    (parameter, stacked index) as the family's loader does."""
    packed_hf = sorted({n.removesuffix(".weight_packed") for n in names if n.endswith(".weight_packed")})
    bad = [n for n in packed_hf if is_ignored(n, qcfg.ignore)]
    if bad:
        raise CheckpointError(f"quantization_config.ignore keeps {bad[:5]} in full precision, but the checkpoint "
                              "stores them packed")
    linears: set[str] = set()
    expert_hits: dict[str, set[tuple[str, int]]] = {}
    for hf in packed_hf:
        mapped = resolve(hf + ".weight")
        if mapped == SKIP:
            continue  # e.g. DeepSeek's MTP layer
        if mapped is None:
            raise CheckpointError(f"packed tensor '{hf}.weight_packed' matches no module of the model")
        pname, index = mapped
        if index is None:
            module = pname.removesuffix(".weight")
            if not isinstance(model.get_submodule(module), nn.Linear):
                raise CheckpointError(f"'{hf}' is packed but '{module}' is not a Linear layer")
            linears.add(module)
        else:
            module, proj = pname.rsplit(".", 1)
            expert_hits.setdefault(module, set()).add((proj, index))
    experts = _stacked_experts(model)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not is_ignored(hf_module_name(name, prefix), qcfg.ignore) \
                and name not in linears:
            raise CheckpointError(f"'{hf_module_name(name, prefix)}' is not in quantization_config.ignore, so it "
                                  "should be packed, but the checkpoint stores it in full precision")
    for name, mod in experts.items():
        n = mod.gate_proj.shape[0]
        want = {(p, e) for p in ("gate_proj", "up_proj", "down_proj") for e in range(n)
                if not is_ignored(hf_module_name(f"{name}.{e}.{p}", prefix), qcfg.ignore)}
        got = expert_hits.get(name, set())
        if got != want:
            missing = sorted(want - got)[:3]
            extra = sorted(got - want)[:3]
            raise CheckpointError(f"routed experts '{hf_module_name(name, prefix)}': packed and ignore list disagree "
                                  f"(unpacked but not ignored: {missing}; packed but ignored: {extra}); a layer's "
                                  "experts must be all packed or all full precision")
    if tied := [n for n in linears if n == "lm_head" and getattr(model.config, "tie_word_embeddings", False)]:
        raise CheckpointError(f"{tied}: a packed lm_head cannot be tied to the embedding")
    return PackPlan(frozenset(linears), frozenset(n for n, hits in expert_hits.items() if hits))


def apply_packing(model: nn.Module, plan: PackPlan, group_size: int) -> None:
    """Swap the planned modules for packed ones (call on the meta-device model, before
    allocation, so the full-precision weights are never materialised)."""
    for name in plan.linears:
        old = model.get_submodule(name)
        parent, attr = _parent(model, name)
        setattr(parent, attr, PackedInt4Linear(old.in_features, old.out_features, group_size, old.bias is not None))
    stacked = getattr(model, "stacked_params", {})
    for name in plan.experts:
        old = model.get_submodule(name)
        e, inner, hidden = old.gate_proj.shape
        parent, attr = _parent(model, name)
        setattr(parent, attr, packed_experts_class(type(old))(e, hidden, inner, group_size))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked.pop(f"{name}.{proj}", None)
            for part in ("packed", "scale", "shape"):
                stacked[f"{name}.{proj}_{part}"] = e


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def packed_name_map(resolve: Callable[[str], Any]) -> Callable[[str], Any]:
    """Extend a family's checkpoint-name map to `X.weight_packed/_scale/_shape`: a Linear's go to
    its buffers of the same name, a routed expert's to slice e of `<proj>_packed` etc."""

    def name_map(name: str):
        for suffix in PACKED_SUFFIXES:
            if name.endswith(suffix):
                mapped = resolve(name.removesuffix(suffix) + ".weight")
                if mapped == SKIP or mapped is None:
                    return mapped
                pname, index = mapped
                if index is None:
                    return pname.removesuffix(".weight") + suffix, None
                return f"{pname}_{suffix.rsplit('_', 1)[1]}", index
        return resolve(name)

    return name_map


def check_packed_shapes(model: nn.Module) -> None:
    """weight_shape tensors must state the shapes the config implies (a mismatch would otherwise
    unpack garbage silently)."""
    for name, mod in model.named_modules():
        if isinstance(mod, PackedInt4Linear):
            got = mod.weight_shape.tolist()
            if got != mod.expected_shape():
                raise CheckpointError(f"'{name}.weight_shape' is {got}, the config implies {mod.expected_shape()}")
        elif hasattr(mod, "dims") and hasattr(mod, "gate_proj_shape"):
            for proj, dims in mod.dims.items():
                bad = [e for e, s in enumerate(getattr(mod, f"{proj}_shape").tolist()) if s != list(dims)]
                if bad:
                    raise CheckpointError(f"'{name}.{bad[0]}.{proj}.weight_shape' disagrees with the config "
                                          f"{list(dims)} (experts {bad[:5]})")
