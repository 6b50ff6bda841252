"""Offline target states for drafter training: `draftsman dump-hidden` writes them once, `draftsman
train --hidden-dir` reads them instead of running the target every step.

Layout of a dump directory:
  index.json              what was dumped: target, aux layer ids (input-of-layer convention),
                          dtype, sizes, the data fingerprint, shard list, `complete`
  shard-00000.safetensors per example i (global index, 8 digits): `{i}.input_ids` [T] int64,
                          `{i}.loss_mask` [T] int64, `{i}.aux_hidden` [T, 3H], `{i}.hidden` [T, H]
                          (final normed), optionally `{i}.logits` [T, V]
Shard s holds examples [s*shard_size, (s+1)*shard_size): boundaries depend only on the data, so a
dump is resumed by skipping the shards already on disk (each is written to a temporary name and
renamed, so a shard that exists is whole).

Training without the target's layers still needs its token embedding (the drafter shares it) and
its lm_head (teacher logits from the final hidden state): `HeadOnlyTarget` loads those two tensors
alone from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from draftsman.config import TargetConfig, load_target_config
from draftsman.train.data import TokenizedConversation
from draftsman.weights import CheckpointError, find_checkpoint_files, iter_tensors, save_safetensors

__all__ = ["HeadOnlyTarget", "HiddenStore", "dump_hidden", "pad_stack"]

INDEX = "index.json"
FORMAT = 1


class HeadOnlyTarget(nn.Module):
    """A target's config, token embedding and lm_head, without its layers. Duck-types the parts of
    TargetModel that the drafter (bind_target, embed, init_drafter) and the teacher use."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32) -> HeadOnlyTarget:
        from draftsman.models import build_target

        config = load_target_config(path)
        with torch.device("meta"):
            names = build_target(config)  # only for its checkpoint-name map
        with torch.device(device):
            model = cls(config).to(dtype)
        wanted = {"embed_tokens.weight": model.embed_tokens.weight, "lm_head.weight": model.lm_head.weight}
        found: set[str] = set()
        for name, file, load in iter_tensors(find_checkpoint_files(path)):
            if config.weight_prefix:
                if not name.startswith(config.weight_prefix):
                    continue
                name = name.removeprefix(config.weight_prefix)
            mapped = names.checkpoint_name(name)
            pname = mapped[0] if isinstance(mapped, tuple) else None
            if pname not in wanted:
                continue
            tensor = load()
            if tuple(tensor.shape) != tuple(wanted[pname].shape):
                raise CheckpointError(f"{file}: '{name}' has shape {list(tensor.shape)}, expected "
                                      f"{list(wanted[pname].shape)}")
            with torch.no_grad():
                wanted[pname].copy_(tensor)
            found.add(pname)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
            found.add("lm_head.weight")
        missing = sorted(set(wanted) - found)
        if missing:
            raise CheckpointError(f"{path}: missing tensors {missing} (needed for offline training)")
        model.source_dir = Path(path)
        return model.eval().requires_grad_(False)


def pad_stack(rows: Sequence[Tensor], length: int | None = None, fill: float | int = 0) -> Tensor:
    """Right-pad [T_i, ...] tensors along dim 0 and stack them: [B, T_max, ...]."""
    length = length or max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


# ---- writing ------------------------------------------------------------------------------------
def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def shard_name(s: int) -> str:
    return f"shard-{s:05d}.safetensors"


@torch.no_grad()
def dump_hidden(
    target,
    examples: Sequence[TokenizedConversation],
    out_dir: str | Path,
    aux_layer_ids: Sequence[int],
    meta: dict[str, Any],
    shard_size: int = 256,
    batch_size: int = 4,
    with_logits: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Run the target over `examples` and write its states, resuming after the last whole shard.

    `meta` names the inputs (target path, data fingerprint, max_length...): a directory holding
    a dump of other inputs is refused rather than mixed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target.config
    dtype = target.embed_tokens.weight.dtype
    index = {
        "format": FORMAT,
        "meta": meta,
        "aux_layer_ids": list(aux_layer_ids),
        "layer_id_convention": "input",
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "with_logits": with_logits,
        "num_examples": len(examples),
        "shard_size": shard_size,
    }
    path = out / INDEX
    if path.exists():
        old = json.loads(path.read_text())
        old_key = {k: v for k, v in old.items() if k not in ("shards", "complete")}
        if old_key != index:
            diff = sorted(k for k in set(old_key) | set(index) if old_key.get(k) != index.get(k))
            raise ValueError(f"{out}: holds a dump of other inputs (differs in {diff}); use a new --out")
    num_shards = math.ceil(len(examples) / shard_size)
    shards = [{"file": shard_name(s), "first": s * shard_size,
               "count": min(shard_size, len(examples) - s * shard_size)} for s in range(num_shards)]
    _write_json_atomic(path, index | {"shards": shards, "complete": False})
    device = target.embed_tokens.weight.device
    for s, shard in enumerate(shards):
        if (out / shard["file"]).exists():
            if progress:
                progress(shard["count"])
            continue
        tensors: dict[str, Tensor] = {}
        first = shard["first"]
        for b in range(first, first + shard["count"], batch_size):
            batch = range(b, min(b + batch_size, first + shard["count"]))
            ids = pad_stack([torch.tensor(examples[i].input_ids) for i in batch]).to(device)
            res = target.run(ids, aux_layer_ids=aux_layer_ids, compute_logits=with_logits)
            aux = torch.cat(res.aux_hidden, -1)
            for j, i in enumerate(batch):
                n = len(examples[i].input_ids)
                key = f"{i:08d}"
                tensors[f"{key}.input_ids"] = ids[j, :n].cpu()
                tensors[f"{key}.loss_mask"] = torch.tensor(examples[i].loss_mask, dtype=torch.int64)
                tensors[f"{key}.aux_hidden"] = aux[j, :n].cpu()
                tensors[f"{key}.hidden"] = res.hidden[j, :n].cpu()
                if with_logits:
                    tensors[f"{key}.logits"] = res.logits[j, :n].cpu()
            if progress:
                progress(len(batch))
        save_safetensors(tensors, out / shard["file"], metadata={"format": "pt", "shard": str(s)})
    _write_json_atomic(path, index | {"shards": shards, "complete": True})
    return out


# ---- reading ------------------------------------------------------------------------------------
class HiddenStore:
    """Random access to a complete dump: `example(i)` -> dict of tensors (memory-mapped reads)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        path = self.dir / INDEX
        if not path.exists():
            raise FileNotFoundError(f"{self.dir}: no {INDEX}: not a dump-hidden directory")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path}: unsupported format {self.index.get('format')} (expected {FORMAT})")
        if not self.index.get("complete"):
            raise ValueError(f"{self.dir}: the dump is incomplete: rerun dump-hidden with the same arguments "
                             "to finish it")
        self.shard_size = int(self.index["shard_size"])
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.index["num_examples"])

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.index["aux_layer_ids"])

    @property
    def with_logits(self) -> bool:
        return bool(self.index["with_logits"])

    def _shard(self, s: int):
        if s not in self._handles:
            from safetensors import safe_open

            self._handles[s] = safe_open(str(self.dir / shard_name(s)), framework="pt", device="cpu")
        return self._handles[s]

    def example(self, i: int, names: Sequence[str] = ("input_ids", "loss_mask", "aux_hidden", "hidden")) -> dict[str, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range (dump holds {len(self)})")
        f = self._shard(i // self.shard_size)
        return {n: f.get_tensor(f"{i:08d}.{n}") for n in names}

    def tokenized(self) -> list[TokenizedConversation]:
        """input_ids and loss_mask of every example (for the vocabulary mapping and lengths)."""
        out = []
        for i in range(len(self)):
            ex = self.example(i, ("input_ids", "loss_mask"))
            out.append(TokenizedConversation(ex["input_ids"].tolist(), ex["loss_mask"].tolist()))
        return out
