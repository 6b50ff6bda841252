"""Target model families and the loader that picks one from config.json.

`load_target(..., device_map="auto")` places a target too large for one GPU as a pipeline: the
decoder layers are split into contiguous blocks over the visible GPUs (sized by their free
memory), embedding / final norm / lm_head stay on the first ("home") device, and each layer on
another device moves its input there and its output back home (forward hooks), so every tensor a
caller sees (logits, aux hidden states, caches' owner) lives on the home device and nothing but
activations crosses devices. Caches are per-layer on each layer's device (ShardedCache).
`place_layers` is the pure splitting rule.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from draftsman.config import TargetConfig, load_target_config
from draftsman.kvcache import StaticCache
from draftsman.models.base import AttnContext, TargetModel, TargetOutput
from draftsman.quant import (
    apply_packing,
    check_packed_shapes,
    checkpoint_tensor_names,
    packed_name_map,
    plan_packing,
    read_quant_config,
)
from draftsman.weights import SKIP, build_empty, default_dtype, load_checkpoint_into

__all__ = ["TargetModel", "TargetOutput", "build_target", "load_target", "place_layers"]

DeviceMap = str | Sequence[str | torch.device] | None


def build_target(config: TargetConfig) -> TargetModel:
    """An uninitialised-but-allocated model of the config's family (on the current device)."""
    if config.family == "deepseek":
        from draftsman.models.deepseek import DeepseekV3Model

        return DeepseekV3Model(config)
    from draftsman.models.llama import LlamaModel

    return LlamaModel(config)


def load_target(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: DeviceMap = None,
    fuse: bool = True,
) -> TargetModel:
    """Load an HF checkpoint directory as a draftsman target model in eval mode.

    INT4 compressed-tensors (pack-quantized) checkpoints load packed and dequantize per layer as
    they compute (draftsman.quant). device_map: None (everything on `device`), "auto" (a
    pipeline over all visible GPUs; `device` when there are none), or a list of devices
    ("cuda:0,cuda:1" or ["cpu", "cpu"]) to split the layers over, in order. fuse: one GEMM for
    q/k/v and for gate/up (TargetModel.fuse_projections; names and state_dict unchanged)."""
    config = load_target_config(path)
    quant = read_quant_config(path)
    names = checkpoint_tensor_names(path) if quant is not None else []
    prefix = config.weight_prefix

    def resolver(model: TargetModel):
        def resolve(name: str):
            if prefix:
                if not name.startswith(prefix):
                    return SKIP  # e.g. a vision tower beside the text backbone
                name = name.removeprefix(prefix)
            return model.checkpoint_name(name)

        return packed_name_map(resolve) if quant is not None else resolve

    def factory() -> TargetModel:
        model = build_target(config)
        if quant is not None:  # on the meta device: full-precision weights are never allocated
            apply_packing(model, plan_packing(model, names, quant, resolver(model), prefix), quant.group_size)
        return model

    devices = resolve_device_map(device_map, device)
    if len(devices) <= 1:
        home = devices[0] if devices else torch.device(device)
        model = build_empty(factory, home, dtype)
        layer_devices = None
    else:
        home = devices[0]
        with torch.device("meta"), default_dtype(dtype):
            model = factory()
        home_bytes = sum(_nbytes(m) for name, m in model.named_children() if name != "layers")
        layer_bytes = [_nbytes(layer) for layer in model.layers]
        capacities = device_capacities(devices)
        index = place_layers(layer_bytes, capacities, home_bytes)
        check_fit(device_loads(layer_bytes, index, len(devices), home_bytes), capacities, devices)
        layer_devices = [devices[i] for i in index]
        _materialize(model, home, layer_devices)
    model.tie_weights()
    load_checkpoint_into(model, path, resolver(model), home, dtype)
    if quant is not None:
        check_packed_shapes(model)
    if layer_devices is not None:
        install_pipeline(model, index, devices)
    model.source_dir = Path(path)
    model = model.eval().requires_grad_(False)
    return model.fuse_projections() if fuse else model


# ---- placement --------------------------------------------------------------------------------
def place_layers(layer_bytes: Sequence[int], capacities: Sequence[float], home_bytes: int = 0) -> list[int]:
    """Contiguous pipeline split: the device index of each layer, in order (activations only move
    forward). Minimises the fullest device's load relative to its capacity, max_d load_d / cap_d,
    where device 0 also holds `home_bytes` (embedding, final norm, lm_head): binary search on that
    ratio, each candidate checked by filling devices greedily in order."""
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"device capacities must be positive, got {list(capacities)}")
    lo, hi = 0.0, (home_bytes + sum(layer_bytes)) / min(capacities)
    best = _fill(layer_bytes, capacities, home_bytes, hi)
    for _ in range(64):
        mid = (lo + hi) / 2
        got = _fill(layer_bytes, capacities, home_bytes, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    assert best is not None  # `hi` starts feasible: everything on device 0
    return best


def _fill(layer_bytes: Sequence[int], capacities: Sequence[float], home_bytes: int, ratio: float) -> list[int] | None:
    """Fill devices in order up to ratio * capacity each; None if the layers do not all fit."""
    limit = [ratio * c * (1 + 1e-12) for c in capacities]
    if home_bytes > limit[0]:
        return None
    d, load, out = 0, float(home_bytes), []
    for b in layer_bytes:
        while load + b > limit[d]:
            d, load = d + 1, 0.0
            if d == len(capacities):
                return None
        out.append(d)
        load += b
    return out


def device_loads(layer_bytes: Sequence[int], placement: Sequence[int], n_devices: int, home_bytes: int = 0) -> list[int]:
    loads = [0] * n_devices
    loads[0] += home_bytes
    for b, d in zip(layer_bytes, placement, strict=True):
        loads[d] += b
    return loads


def check_fit(loads: Sequence[int], capacities: Sequence[float], devices: Sequence[torch.device]) -> None:
    """Weights per GPU must fit its free memory (CPU devices report no capacity)."""
    if not all(d.type == "cuda" for d in devices):
        return
    over = [f"{d}: {load / 2**30:.1f} GiB of weights, {cap / 2**30:.1f} GiB free"
            for d, load, cap in zip(devices, loads, capacities, strict=True) if load > cap]
    if over:
        raise ValueError(f"the target does not fit the GPUs' free memory ({'; '.join(over)}); total "
                         f"{sum(loads) / 2**30:.1f} GiB over {len(devices)} devices")


def resolve_device_map(device_map: DeviceMap, device: str | torch.device) -> list[torch.device]:
    """The devices a target is spread over, in pipeline order ([] = just `device`)."""
    if device_map is None:
        return []
    if isinstance(device_map, str):
        if device_map == "auto":
            if torch.cuda.is_available():
                return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
            return [torch.device(device)]
        device_map = [d for d in device_map.split(",") if d.strip()]
    devices = [torch.device(d.strip() if isinstance(d, str) else d) for d in device_map]
    if not devices:
        raise ValueError("device_map lists no devices")
    return devices


def device_capacities(devices: Sequence[torch.device]) -> list[float]:
    """Free memory of each GPU; equal shares when any device is not a GPU (CPU tests)."""
    if all(d.type == "cuda" for d in devices):
        return [float(torch.cuda.mem_get_info(d)[0]) for d in devices]
    return [1.0] * len(devices)


def _nbytes(module: nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _materialize(model: TargetModel, home: torch.device, layer_devices: Sequence[torch.device]) -> None:
    """Allocate a meta-built model: layer i on layer_devices[i], everything else at home."""
    for name, child in model.named_children():
        if name == "layers":
            for layer, dev in zip(child, layer_devices, strict=True):
                layer.to_empty(device=dev)
        else:
            child.to_empty(device=home)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()


# ---- pipeline execution -----------------------------------------------------------------------
class _ContextMover:
    """Moves one forward's AttnContext to a device once, for every layer there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last: tuple[AttnContext, AttnContext] | None = None

    def __call__(self, ctx: AttnContext) -> AttnContext:
        if self.last is not None and self.last[0] is ctx:
            return self.last[1]
        dev = self.device
        moved = AttnContext(ctx.cos.to(dev), ctx.sin.to(dev), ctx.mask.to(dev), ctx.cache,
                            None if ctx.cache_index is None else ctx.cache_index.to(dev),
                            None if ctx.limit is None else ctx.limit.to(dev))
        self.last = (ctx, moved)
        return moved


def install_pipeline(model: TargetModel, index: Sequence[int], devices: Sequence[torch.device]) -> None:
    """Hooks on every layer placed off device 0 (by index, so a CPU-only split exercises them):
    input and context to the layer's device, output back home. Caches become per-layer."""
    home = devices[0]
    movers = {d: _ContextMover(devices[d]) for d in set(index) if d != 0}
    for layer, d in zip(model.layers, index, strict=True):
        if d == 0:
            continue
        dev, mover = devices[d], movers[d]

        def pre(module, args, dev=dev, mover=mover):
            x, ctx, *rest = args
            return (x.to(dev), mover(ctx), *rest)

        def post(module, args, output, home=home):
            return output.to(home)

        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    model.layer_devices = [devices[d] for d in index]
    model.new_cache = types.MethodType(_sharded_new_cache, model)


def _sharded_new_cache(self: TargetModel, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> StaticCache:
    return ShardedCache.allocate_layers(self.cache_layout(), self.layer_devices, batch_size, max_len,
                                        dtype or self.embed_tokens.weight.dtype)


class ShardedCache(StaticCache):
    """StaticCache with each layer's tensors on that layer's device (same slot semantics)."""

    def __init__(self, layers: list[dict[str, Tensor]]) -> None:
        self.layers = layers
        first = next(iter(layers[0].values()))
        self.num_layers, self.batch_size, self.max_len = len(layers), first.shape[0], first.shape[1]

    @classmethod
    def allocate_layers(cls, layout: dict[str, tuple[int, ...]], devices: Sequence[torch.device], batch_size: int,
                        max_len: int, dtype: torch.dtype) -> ShardedCache:
        return cls([{name: torch.zeros(batch_size, max_len, *tail, device=dev, dtype=dtype)
                     for name, tail in layout.items()} for dev in devices])

    def write(self, layer: int, index: Tensor, **values: Tensor) -> None:
        bufs = self.layers[layer]
        for name, value in values.items():
            buf = bufs[name]
            idx = index.to(buf.device)
            rows = torch.arange(idx.shape[0], device=buf.device)[:, None]
            buf[rows, idx] = value.to(buf.device, buf.dtype)

    def read(self, layer: int, name: str, length: int) -> Tensor:
        return self.layers[layer][name][:, :length]

    def compact(self, src: Tensor, dst: Tensor) -> None:
        for bufs in self.layers:
            for buf in bufs.values():
                s, d = src.to(buf.device), dst.to(buf.device)
                rows = torch.arange(s.shape[0], device=buf.device)[:, None]
                buf[rows, d] = buf[rows, s]

    appends_shorter = False  # (append_rows needs caches of the same length)

    def select_rows(self, rows: Tensor, slots: int | None = None) -> None:
        for bufs in self.layers:
            for name, buf in bufs.items():
                bufs[name] = buf[rows.to(buf.device)].contiguous()
        self.batch_size = int(rows.numel())

    def drop_rows(self) -> None:
        self.select_rows(torch.empty(0, dtype=torch.long))

    def append_rows(self, other: StaticCache) -> None:
        if not isinstance(other, ShardedCache) or (other.num_layers, other.max_len) != (self.num_layers, self.max_len):
            raise ValueError("appended cache rows must be a ShardedCache with the same layers and max_len")
        for bufs, theirs in zip(self.layers, other.layers, strict=True):
            for name, buf in bufs.items():
                bufs[name] = torch.cat([buf, theirs[name].to(buf.device)], dim=0)
        self.batch_size += other.batch_size

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self.layers for b in bufs.values())
