"""The drafter's vocabulary: the N target tokens it can propose (d2t / t2d, as EAGLE-3 stores them).

The draft vocabulary is the N most frequent target tokens under the loss mask (the tokens the
drafter is trained to predict), sorted by target id as SpecForge builds it. d2t holds offsets
(target_id = draft_id + d2t[draft_id]); t2d marks the chosen target ids.

Counting a large corpus takes minutes, so `cached_vocab_mapping` keeps the result under a file
name hashed from everything it depends on (data and tokenizer contents, sizes, max_length): a
changed input gives a new name, so a stale mapping is never read back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsman.train.data import TokenizedConversation

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the selection rule changes: old cache files then stop matching
_CHUNK = 1 << 20  # token ids gathered before each bincount


@dataclass
class VocabMapping:
    d2t: Tensor  # int64 [N]: target_id = draft_id + d2t[draft_id]
    t2d: Tensor  # bool [V]: target ids in the draft vocabulary
    draft_token_ids: Tensor  # int64 [N]: target id of each draft row, ascending
    counts: Tensor  # int64 [V]: occurrences of each target id under the loss mask


def count_masked_tokens(examples: Iterable[TokenizedConversation], vocab_size: int) -> Tensor:
    """int64 [vocab_size]: how often each id occurs where loss_mask is 1."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    pending: list[int] = []

    def flush() -> None:
        ids = torch.tensor(pending, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
            raise ValueError(f"token ids {bad} lie outside the target vocabulary 0..{vocab_size - 1}")
        counts.add_(torch.bincount(ids, minlength=vocab_size))
        pending.clear()

    for ex in examples:
        if len(ex.input_ids) != len(ex.loss_mask):
            raise ValueError(f"input_ids ({len(ex.input_ids)}) and loss_mask ({len(ex.loss_mask)}) differ in length")
        pending.extend(t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m)
        if len(pending) >= _CHUNK:
            flush()
    flush()
    return counts


def mapping_from_counts(counts: Tensor, draft_vocab_size: int) -> VocabMapping:
    """The N = min(draft_vocab_size, V) most frequent ids (ties and unseen ids: lowest id first)."""
    vocab_size = counts.numel()
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    n = min(draft_vocab_size, vocab_size)
    # A stable sort on -count keeps ascending ids within equal counts, so unseen ids fill by id.
    order = torch.sort(-counts, stable=True).indices[:n]
    ids = torch.sort(order).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return VocabMapping(d2t=ids - torch.arange(n), t2d=t2d, draft_token_ids=ids, counts=counts)


def build_vocab_mapping(
    examples: Iterable[TokenizedConversation], vocab_size: int, draft_vocab_size: int = 32000
) -> VocabMapping:
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return mapping_from_counts(count_masked_tokens(examples, vocab_size), draft_vocab_size)


# ---- cache --------------------------------------------------------------------------------------
def fingerprint_files(paths: Iterable[str | Path] | str | Path) -> str:
    """sha256 over the contents of `paths`, in the order given (each prefixed by its size)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.stat().st_size.to_bytes(8, "little"))
        with p.open("rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces; non-JSON values raise TypeError."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def cache_path(cache_dir: str | Path, vocab_size: int, draft_vocab_size: int, key: dict) -> tuple[Path, str]:
    """(cache file, canonical key text stored inside it)."""
    text = canonical_json({"format": CACHE_FORMAT, "vocab_size": vocab_size,
                           "draft_vocab_size": draft_vocab_size, "key": key})
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Path(cache_dir) / f"vocab_mapping-{digest}.safetensors", text


def cached_vocab_mapping(
    examples_factory: Callable[[], Iterable[TokenizedConversation]],
    vocab_size: int,
    draft_vocab_size: int,
    cache_dir: str | Path,
    key: dict,
) -> VocabMapping:
    """build_vocab_mapping(examples_factory(), ...), kept under cache_dir keyed by `key`.

    `key` must name everything the mapping depends on beyond the sizes: data file contents
    (fingerprint_files), tokenizer files, max_length. The factory is called only on a miss.
    """
    path, text = cache_path(cache_dir, vocab_size, draft_vocab_size, key)
    if path.exists():
        cached = _load(path, text, vocab_size)
        if cached is not None:
            logger.info("vocab mapping: cache hit %s", path)
            return cached
    mapping = build_vocab_mapping(examples_factory(), vocab_size, draft_vocab_size)
    _save_atomic(mapping, path, text)
    logger.info("vocab mapping: wrote %s", path)
    return mapping


def _load(path: Path, text: str, vocab_size: int) -> VocabMapping | None:
    """The cached mapping, or None (with a warning) when the file is unreadable or not this key's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("key") != text:
                logger.warning("vocab mapping cache %s was written for another key; recomputing", path)
                return None
            mapping = VocabMapping(**{name: f.get_tensor(name) for name in ("d2t", "t2d", "draft_token_ids", "counts")})
    except (OSError, SafetensorError, KeyError) as e:
        logger.warning("vocab mapping cache %s is unreadable (%s); recomputing", path, e)
        return None
    if mapping.t2d.numel() != vocab_size or mapping.counts.numel() != vocab_size:
        logger.warning("vocab mapping cache %s has the wrong vocabulary size; recomputing", path)
        return None
    return mapping


def _save_atomic(mapping: VocabMapping, path: Path, text: str) -> None:
    """Write to a temporary name then rename, so a reader (another rank) never sees half a file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tensors = {"d2t": mapping.d2t, "t2d": mapping.t2d, "draft_token_ids": mapping.draft_token_ids,
               "counts": mapping.counts}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"key": text})
    os.replace(tmp, path)
