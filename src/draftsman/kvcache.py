"""Static caches, allocated once and indexed by slot.

Every cached tensor has shape [layers, batch, slots, ...]. A token is written at the slot the
caller chooses, so a rejected draft is simply overwritten later (no rollback), and accepted tree
nodes are moved into place with `compact`. Standard attention stores keys and values; MLA stores
its compressed latent and the rotated shared key (`kv_lora_rank + qk_rope_head_dim` per token).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from draftsman.graphs import pow2_ceil


class StaticCache:
    """`buffers[name]` is a view of the first `batch_size` rows of a larger `_base` allocation:
    rows leave and join by copying within it, so the buffers keep their address (CUDA graphs
    captured over them stay valid) unless joining rows outgrow the allocation."""

    def __init__(self, buffers: dict[str, Tensor]) -> None:
        shapes = {tuple(b.shape[:3]) for b in buffers.values()}
        if len(shapes) != 1:
            raise ValueError(f"cache buffers disagree on [layers, batch, slots]: {shapes}")
        self._base = dict(buffers)
        self._padded: dict[int, tuple] = {}  # rows -> (buffers, per-layer views) of padded()
        self.buffers = dict(buffers)
        self.num_layers, self.batch_size, self.max_len = shapes.pop()

    @property
    def buffers(self) -> dict[str, Tensor]:
        return self._buffers

    @buffers.setter
    def buffers(self, buffers: dict[str, Tensor]) -> None:
        # Layers are written and read through views made here, outside any compiled code: given
        # the whole [layers, ...] buffer, torch.compile turns each layer's in-place write into a
        # copy of that layer's slice and copies the whole buffer back at the end (tens of
        # microseconds per decode step on the GPU); given per-layer tensors, it writes in place.
        self._buffers, self._layers = buffers, layer_views(buffers)

    @classmethod
    def allocate(
        cls,
        layout: dict[str, tuple[int, ...]],
        num_layers: int,
        batch_size: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> StaticCache:
        """layout maps a buffer name to its per-token trailing shape, e.g. {"k": (8, 64)}."""
        return cls(
            {
                name: torch.zeros(num_layers, batch_size, max_len, *tail, device=device, dtype=dtype)
                for name, tail in layout.items()
            }
        )

    def write(self, layer: int, index: Tensor, **values: Tensor) -> None:
        """Store values [B, T, ...] at slots index [B, T] of one layer."""
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
        for name, value in values.items():
            buf = self._layers[name][layer]
            buf[rows, index] = value.to(buf.dtype)

    def read(self, layer: int, name: str, length: int) -> Tensor:
        """The first `length` slots of one layer's buffer: [B, length, ...]."""
        return self._layers[name][layer][:, :length]

    def compact(self, src: Tensor, dst: Tensor) -> None:
        """For every layer and row b, copy slots src[b] to slots dst[b] (both [B, N]).

        Used after tree verification: the accepted path's entries move next to the prefix.
        Entries are gathered before any is written, so overlapping ranges are safe."""
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        for buf in self.buffers.values():
            buf[:, rows, dst] = buf[:, rows, src]

    @property
    def capacity(self) -> int:
        return next(iter(self._base.values())).shape[1]

    # append_rows takes caches of fewer slots (a newcomer's prefill sized to its prompt)
    appends_shorter = True

    def select_rows(self, rows: Tensor, slots: int | None = None) -> None:
        """Keep only the given batch rows (in that order), moved to the front in place: requests
        leaving a running batch. slots: only slots below this hold anything the rows still need
        (the rest is copied over only up to it: a server's rows have thousands of slots, and
        moving them all on every leave cost more than decoding on CPU); the slots past it keep
        whatever they held, which no mask lets a token see before it is written again."""
        k = int(rows.numel())
        s = self.max_len if slots is None else max(0, min(slots, self.max_len))
        for name, base in self._base.items():
            base[:, :k, :s] = self.buffers[name][:, rows, :s]  # gathered before written: overlap is safe
        self.buffers = {name: base[:, :k] for name, base in self._base.items()}
        self.batch_size = k

    def reserve(self, rows: int) -> None:
        """Grow the allocation (to a power of two) to hold `rows` rows, keeping the live ones."""
        if rows <= self.capacity:
            return
        grown = pow2_ceil(rows)
        b = self.batch_size
        for name, base in self._base.items():
            new = base.new_zeros(base.shape[0], grown, *base.shape[2:])
            new[:, :b] = self.buffers[name]
            self._base[name] = new
        self._padded.clear()
        self.buffers = {name: base[:, :b] for name, base in self._base.items()}

    @contextmanager
    def padded(self, rows: int) -> Iterator[None]:
        """Present `rows` >= batch_size rows for one step (the extra rows are scratch: a graph
        captured for a padded batch serves every smaller batch in its bucket)."""
        self.reserve(rows)
        saved = self._buffers, self._layers, self.batch_size
        if rows not in self._padded:  # made once per size: a step's host time stays off the views
            buffers = {n: b[:, :rows] for n, b in self._base.items()}
            self._padded[rows] = buffers, layer_views(buffers)
        (self._buffers, self._layers), self.batch_size = self._padded[rows], rows
        try:
            yield
        finally:
            self._buffers, self._layers, self.batch_size = saved

    def append_rows(self, other: StaticCache) -> None:
        """Add the rows of `other` (same layers, at most as many slots) after this cache's rows:
        requests joining a running batch; slots past other's keep whatever they held (see
        select_rows). The allocation grows (to a power of two) only when full."""
        if other.num_layers != self.num_layers or other.max_len > self.max_len:
            raise ValueError(f"appended cache rows must have the same layers ({self.num_layers}) and at most "
                             f"{self.max_len} slots, got {other.num_layers} layers and {other.max_len} slots")
        b, m, s = self.batch_size, other.batch_size, other.max_len
        self.reserve(b + m)
        for name, base in self._base.items():
            base[:, b : b + m, :s] = other.buffers[name]
        self.buffers = {name: base[:, : b + m] for name, base in self._base.items()}
        self.batch_size = b + m

    def use_rows(self, rows: int) -> None:
        """Present the first `rows` rows of the allocation (growing it if needed), whatever they
        hold: a staging cache that a prefill then overwrites."""
        self.reserve(rows)
        self.buffers = {name: base[:, :rows] for name, base in self._base.items()}
        self.batch_size = rows

    def drop_rows(self) -> None:
        """Every row leaves (views of none: no copy, the allocation kept)."""
        self.use_rows(0)

    def clone_rows(self) -> StaticCache:
        """A new cache holding copies of the live rows (an allocation of its own)."""
        return StaticCache({name: buf.clone() for name, buf in self.buffers.items()})

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def layer_views(buffers: dict[str, Tensor]) -> dict[str, list[Tensor]]:
    """Each buffer's per-layer views [batch, slots, ...]."""
    with torch.enable_grad():  # views made under no_grad could not be written with grad on
        return {name: [buf[i] for i in range(buf.shape[0])] for name, buf in buffers.items()}
