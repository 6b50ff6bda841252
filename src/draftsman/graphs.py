"""CUDA graphs: capture a forward once for fixed shapes and replay it with one launch.

A decode step of a large model is hundreds of small kernels; launched one by one from Python the
GPU idles between them (host-bound). A graph replays the whole step from static input/output
buffers, so the function captured must be free of host syncs and of shapes that depend on data:
callers size masks from what the host knows (`DecodeSession.span`), never `int(n.max())`.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import torch
from torch import Tensor

Outputs = Tensor | tuple[Tensor, ...]


class CudaGraphRunner:
    """`fn(**inputs)` captured for the shapes, dtypes and devices of `example` inputs.

    Calling the runner copies new inputs into the static buffers and replays the graph; the
    returned tensors are the graph's static outputs, overwritten by the next call (clone what
    must outlive it). Tensors `fn` reads besides its inputs (weights, caches) are captured by
    address: they must stay the same tensor objects for the runner's life."""

    def __init__(self, fn: Callable[..., Outputs], example: dict[str, Tensor], warmup: int = 2,
                 pool: tuple | None = None) -> None:
        if not all(t.is_cuda for t in example.values()):
            raise ValueError("CUDA graphs need CUDA input tensors")
        self.inputs = {k: v.clone() for k, v in example.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            for _ in range(warmup):
                fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(**self.inputs)

    def pool(self) -> tuple:
        """The graph's memory pool, to share with graphs that never run concurrently."""
        return self.graph.pool()

    def __call__(self, **inputs: Tensor) -> Outputs:
        for name, value in inputs.items():
            self.inputs[name].copy_(value)
        self.graph.replay()
        return self.outputs


def compile_step(fn: Callable[..., Outputs]) -> Callable[..., Outputs]:
    """torch.compile a step function for fixed shapes (fusing the small elementwise kernels a
    graph would still launch one by one). Inside compiled code attention cannot pick its SDPA
    backend per call, so cuDNN's fused attention (a plan built per shape) is turned off
    process-wide here."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=compile_mode())


def compile_mode() -> str | None:
    """torch.compile's mode for draftsman's steps: DRAFTSMAN_COMPILE_MODE (e.g.
    "max-autotune-no-cudagraphs": Triton GEMMs with fused epilogues, long compiles), else the
    default. Modes that capture CUDA graphs themselves are refused: draftsman captures its own."""
    mode = os.environ.get("DRAFTSMAN_COMPILE_MODE") or None
    if mode in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"DRAFTSMAN_COMPILE_MODE={mode}: that mode captures CUDA graphs itself; use "
                         "default or max-autotune-no-cudagraphs")
    return mode


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): sizes rounded so, a few graph shapes serve
    every batch size, attention span and cache allocation."""
    return 1 << max(n - 1, 0).bit_length()


def captures(*modules: torch.nn.Module | None) -> int:
    """CUDA graphs captured so far for these modules' tables (0 off CUDA): each capture costs
    several steps, so timings that include one are not the steady state."""
    return sum(graph_table(m).captures for m in modules if m is not None)


def failures(*modules: torch.nn.Module | None) -> int:
    """Steps whose capture failed so far for these modules' tables (they run eagerly)."""
    return sum(len(graph_table(m).failed) for m in modules if m is not None)


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs on CUDA devices unless DRAFTSMAN_CUDA_GRAPHS=0 (eager, for debugging)."""
    return device.type == "cuda" and os.environ.get("DRAFTSMAN_CUDA_GRAPHS", "1") != "0"


def signature(inputs: dict[str, Tensor], bound: Iterable[Tensor] = (), rows: int | None = None) -> tuple:
    """Graph key part: input shapes/dtypes, and the identity (address, shape, strides) of tensors
    the step writes or reads outside its inputs (cache buffers), which a graph holds by address.
    rows: the inputs' first dimension as it will be (padded), if not as it is."""
    return (tuple((k, (v.shape[0] if rows is None else rows, *v.shape[1:]), v.dtype) for k, v in inputs.items()),
            tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in bound))


class GraphTable:
    """Graphs of one module's steps, captured on first use of a key and replayed after; the least
    recently used is dropped beyond `max_graphs`. All share one memory pool (steps of a module
    never run concurrently; each graph's outputs stay allocated while it is kept). A graph's
    outputs may sit where a graph captured earlier keeps its scratch, so replaying that one
    overwrites them: consume outputs before the next replay, or clone what must persist."""

    def __init__(self, max_graphs: int = 256) -> None:
        # Room for every (batch bucket x attention span) shape of several speculation arms (an
        # adaptive session switches among them): an evicted graph is recaptured, at the cost of
        # several rounds, the next time its shape comes up. Graphs share one pool, so more of
        # them cost little memory beyond their outputs.
        self.max_graphs = max_graphs
        self.runners: OrderedDict[Hashable, CudaGraphRunner] = OrderedDict()
        self._pool: tuple | None = None
        self.captures = 0
        self.failed: dict[Hashable, str] = {}  # keys whose capture failed: run eagerly, with why

    def has(self, key: Hashable) -> bool:
        """Whether running `key` needs no capture (captured already, or known to run eagerly)."""
        return key in self.runners or key in self.failed

    def run(self, key: Hashable, fn: Callable[..., Outputs], inputs: dict[str, Tensor]) -> Outputs:
        if key in self.failed:
            return fn(**inputs)
        runner = self.runners.get(key)
        if runner is None:
            while len(self.runners) >= self.max_graphs:
                self.runners.popitem(last=False)
            try:
                runner = CudaGraphRunner(fn, inputs, pool=self._pool)
            except RuntimeError as e:  # e.g. a host sync in fn: correct eagerly, only slower
                self.failed[key] = f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph capture failed, running this step eagerly: {e}", stacklevel=2)
                torch.cuda.synchronize()
                return fn(**inputs)
            self._pool = self._pool or runner.pool()
            self.runners[key] = runner
            self.captures += 1
        else:
            self.runners.move_to_end(key)
        return runner(**inputs)


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_table(module: torch.nn.Module) -> GraphTable:
    """The graph table of a module (one per model, shared by every session that runs it)."""
    table = _TABLES.get(module)
    if table is None:
        table = _TABLES[module] = GraphTable()
    return table


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Distinct static shapes one compiled forward may see (batch sizes x token counts of decode,
# draft, verify and extension steps) before dynamo would give up and run it eagerly.
RECOMPILE_LIMIT = 64


def compiled(module: torch.nn.Module, method: str = "forward") -> Callable:
    """torch.compile'd `module.<method>`, one per module and method (shared by every session),
    specialised per input shape (dynamic=False: each decode/verify shape gets its own kernels,
    then its own CUDA graph). Caches passed in are ordinary inputs, so new caches of the same
    shape reuse the compiled code."""
    table = _COMPILED.setdefault(module, {})
    if method not in table:
        import torch._dynamo.config as dynamo_config

        torch.backends.cuda.enable_cudnn_sdp(False)  # see compile_step
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        table[method] = torch.compile(getattr(module, method), dynamic=False, mode=compile_mode())
    return table[method]
