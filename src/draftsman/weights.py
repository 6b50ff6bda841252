"""Checkpoint loading: single or sharded safetensors (memory-mapped), or `pytorch_model.bin` read
with `weights_only=True`; tensors go straight into the model's parameters on the target device
and dtype. Errors name the file and tensor at fault.

On CUDA, tensors are read on the host by several threads and copied to the GPU through pinned
(page-locked) buffers, one per thread, asynchronously on the thread's own stream: a pageable
source would make each copy synchronous and staged by the driver."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

# name -> (parameter name, index into its first dim or None), "skip" to ignore, or None = unexpected
NameMap = Callable[[str], "tuple[str, int | None] | str | None"]
SKIP = "skip"


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the model: the message names the file and tensor."""


@dataclass
class CheckpointFiles:
    directory: Path
    files: list[Path] = field(default_factory=list)
    kind: str = "safetensors"  # or "bin"


def find_checkpoint_files(directory: str | Path) -> CheckpointFiles:
    """model.safetensors, model.safetensors.index.json (sharded), any *.safetensors, or pytorch_model.bin."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard files listed but absent: {missing}")
        return CheckpointFiles(d, files)
    if (d / "model.safetensors").exists():
        return CheckpointFiles(d, [d / "model.safetensors"])
    shards = sorted(d.glob("*.safetensors"))
    if shards:
        return CheckpointFiles(d, shards)
    if (d / "pytorch_model.bin").exists():
        return CheckpointFiles(d, [d / "pytorch_model.bin"], kind="bin")
    raise CheckpointError(
        f"{d}: no weights found (expected model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


@contextmanager
def _open_safetensors(path: Path, device: str):
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            yield f
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for bad headers/sizes
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from None


def iter_tensors(ckpt: CheckpointFiles, device: str = "cpu", before_close: Callable[[], None] | None = None
                 ) -> Iterator[tuple[str, Path, Callable[[], Tensor]]]:
    """Yield (name, file, loader) lazily; a loader reads one tensor from the memory-mapped file,
    valid until that file is closed (after its last tensor; `before_close()` runs just before)."""
    if ckpt.kind == "bin":
        path = ckpt.files[0]
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot be read as a weights-only torch file ({e})") from None
        for name, tensor in state.items():
            yield name, path, (lambda t=tensor: t)
        return
    for path in ckpt.files:
        with _open_safetensors(path, device) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)

                def load(f=f, name=name, path=path) -> Tensor:
                    try:
                        return f.get_tensor(name)
                    except Exception as e:
                        raise CheckpointError(f"{path}: tensor '{name}' cannot be read ({e})") from None

                yield name, path, load
            if before_close is not None:
                before_close()


def load_checkpoint_into(
    model: nn.Module,
    directory: str | Path,
    name_map: NameMap,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_dtype: tuple[str, ...] = (),
    staged: bool | None = None,
) -> None:
    """Fill every parameter/buffer of `model` from the checkpoint in `directory`.

    Raises CheckpointError naming each missing tensor, unexpected tensor, or shape mismatch.
    Tensors whose target name ends with one of `keep_dtype` keep the model's dtype for them
    (e.g. int64 `d2t`, bool `t2d`). staged: copy to CUDA through pinned buffers from worker
    threads (default on CUDA; DRAFTSMAN_STAGED_LOAD=0 turns it off), else tensor by tensor."""
    ckpt = find_checkpoint_files(directory)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    loaded: dict[str, set[int | None]] = {}
    unexpected: list[str] = []
    cuda = torch.device(device).type == "cuda"
    if staged is None:
        staged = cuda and ckpt.kind == "safetensors" and os.environ.get("DRAFTSMAN_STAGED_LOAD", "1") != "0"
    stager = PinnedStager() if staged and cuda else None
    read_device = str(device) if cuda and stager is None else "cpu"
    try:  # a file's copies end before it is closed
        for name, path, load in iter_tensors(ckpt, read_device, stager.wait if stager is not None else None):
            mapped = name_map(name)
            if mapped == SKIP:
                continue
            if mapped is None or mapped[0] not in targets:
                unexpected.append(f"{name} (in {path.name})")
                continue
            pname, index = mapped
            dest = targets[pname] if index is None else targets[pname][index]
            where = f"{path}: tensor '{name}'"
            expected = f"{list(dest.shape)} for '{pname}'" + ("" if index is None else f"[{index}]")
            if stager is not None:
                stager.submit(dest, load, where, expected)
            else:
                _fill(dest, load(), where, expected)
            loaded.setdefault(pname, set()).add(index)
    except BaseException:
        if stager is not None:  # stop the copies still queued; the first error is the one to report
            stager.pool.shutdown(cancel_futures=True)
        raise
    if stager is not None:
        stager.close()
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected tensors in checkpoint: {unexpected[:20]}"
                              + (f" and {len(unexpected) - 20} more" if len(unexpected) > 20 else ""))
    missing = _missing(model, targets, loaded)
    if missing:
        raise CheckpointError(f"{directory}: missing tensors in checkpoint: {missing[:20]}"
                              + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))


def _check_shape(tensor: Tensor, dest: Tensor, where: str, expected: str) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise CheckpointError(f"{where} has shape {list(tensor.shape)}, but the model expects {expected}")


def _fill(dest: Tensor, tensor: Tensor, where: str, expected: str) -> None:
    _check_shape(tensor, dest, where, expected)
    with torch.no_grad():
        dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))


class PinnedStager:
    """Host tensors to their CUDA destinations from `workers` threads, each with a pinned buffer
    and a stream: read (safetensors, from the page cache or disk) -> copy into the pinned buffer
    -> asynchronous host-to-device copy, the threads overlapping each other's stages. Tensors
    larger than a buffer go in pieces; a dtype change happens on the GPU after the copy."""

    def __init__(self, workers: int = 8, buffer_bytes: int = 1 << 27) -> None:
        self.buffer_bytes = buffer_bytes
        self.pool = ThreadPoolExecutor(max(1, min(workers, os.cpu_count() or 1)))
        self.local = threading.local()
        self.pending: list[Future] = []

    def submit(self, dest: Tensor, load: Callable[[], Tensor], where: str, expected: str) -> None:
        self.pending.append(self.pool.submit(self._copy, dest, load, where, expected))

    def wait(self) -> None:
        """Every submitted copy done (the first error re-raised)."""
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.pool.shutdown()

    def _copy(self, dest: Tensor, load: Callable[[], Tensor], where: str, expected: str) -> None:
        try:
            self._copy_unchecked(dest, load, where, expected)
        except CheckpointError:
            raise
        except Exception as e:  # e.g. out of GPU or pinned memory: say which tensor
            raise CheckpointError(f"{where}: copy to {dest.device} failed ({type(e).__name__}: {e})") from e

    def _copy_unchecked(self, dest: Tensor, load: Callable[[], Tensor], where: str, expected: str) -> None:
        src = load()
        _check_shape(src, dest, where, expected)
        local = self.local
        if not hasattr(local, "buffer"):
            local.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)
            local.stream = torch.cuda.Stream(dest.device)
        # Same dtype and layout: raw bytes straight into the destination; else via a GPU temporary.
        direct = src.dtype == dest.dtype and dest.is_contiguous()
        target = dest if direct else torch.empty(src.shape, dtype=src.dtype, device=dest.device)
        src_bytes = src.contiguous().view(-1).view(torch.uint8)
        out_bytes = target.view(-1).view(torch.uint8)
        with torch.no_grad(), torch.cuda.stream(local.stream):
            for start in range(0, src_bytes.numel(), self.buffer_bytes):
                n = min(self.buffer_bytes, src_bytes.numel() - start)
                local.stream.synchronize()  # the buffer's previous copy has left it
                local.buffer[:n].copy_(src_bytes[start : start + n])
                out_bytes[start : start + n].copy_(local.buffer[:n], non_blocking=True)
            if not direct:
                dest.copy_(target)
        local.stream.synchronize()


def _missing(model: nn.Module, targets: dict[str, Tensor], loaded: dict[str, set[int | None]]) -> list[str]:
    persistent = {n for n, _ in model.named_parameters()} | set(model.state_dict().keys())
    missing = []
    for pname, tensor in targets.items():
        if pname not in persistent:
            continue
        got = loaded.get(pname, set())
        if None in got:
            continue
        stacked = getattr(model, "stacked_params", {}).get(pname)
        if stacked is not None and got and len(got) == tensor.shape[0]:
            continue
        if stacked is not None and got:
            missing += [f"{pname}[{i}]" for i in range(tensor.shape[0]) if i not in got]
        else:
            missing.append(pname)
    return missing


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_empty(factory: Callable[[], nn.Module], device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Build a module without initialising weights (meta device), then allocate it once on `device`.
    Non-persistent buffers are recomputed by the module's `init_buffers()`."""
    with torch.device("meta"), default_dtype(dtype):
        model = factory()
    model = model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    return model


def save_safetensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temp file + rename), contiguous CPU tensors, no shared storage."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(tmp),
              metadata=metadata or {"format": "pt"})
    tmp.replace(path)
