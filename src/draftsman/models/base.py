"""What every target model shares: the forward loop over decoder layers, aux-state capture,
cache/mask conventions. Families implement the layers and a weight-name map."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsman.config import TargetConfig
from draftsman.kvcache import StaticCache
from draftsman.models.layers import RMSNorm, attention_limit, fuse_projections, resolve_slots


@dataclass
class AttnContext:
    """Per-forward inputs every attention layer reads."""

    cos: Tensor  # [B, T, rotary_dim]
    sin: Tensor
    mask: Tensor  # [B, T, S] bool: over the new tokens (no cache) or over cache slots
    cache: StaticCache | None = None
    cache_index: Tensor | None = None  # [B, T] slot each new token is written to
    limit: Tensor | None = None  # [B] int32: no slot at or past it is visible (layers.attention_limit)
    # Fused batch-1 decode layers (llama.LlamaDecoderLayer.decode_fused): partial sums of squares
    # of the last layer's output row, which the next layer's norm reads instead of recomputing.
    norm_ss: Tensor | None = None


@dataclass
class TargetOutput:
    logits: Tensor | None  # [B, T or K, vocab]
    aux_hidden: list[Tensor]  # one [B, T, H] per requested layer id, in the order asked
    hidden: Tensor  # final normed hidden states [B, T, H]


class TargetModel(nn.Module, ABC):
    """A causal LM: `model(input_ids)` -> logits; `model.run(...)` for caches and aux states."""

    config: TargetConfig
    stacked_params: dict[str, int]  # params whose first dim stacks per-expert checkpoint tensors

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.stacked_params = {}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layers = nn.ModuleList()
        self.rotary: nn.Module  # set by the family

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # ---- caches -------------------------------------------------------------------------
    @abstractmethod
    def cache_layout(self) -> dict[str, tuple[int, ...]]:
        """Per-token trailing shape of each cached tensor, e.g. {"k": (Hkv, D), "v": (Hkv, D)}."""

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> StaticCache:
        """Slots may exceed max_position_embeddings (speculation needs scratch room past the
        last position); callers check positions against the model's window."""
        return StaticCache.allocate(
            self.cache_layout(),
            len(self.layers),
            batch_size,
            max_len,
            device=self.embed_tokens.weight.device,
            dtype=dtype or self.embed_tokens.weight.dtype,
        )

    def fuse_projections(self) -> TargetModel:
        """Fuse projections that read the same input (q/k/v, gate/up) into one GEMM each, for
        inference; parameter names, values and the state_dict are unchanged (the originals
        become views of the fused weights, which are not registered). Call it once the model
        sits on its final device: moving it afterwards would leave the fused weights behind."""
        fuse_projections(self)
        return self

    # ---- forward ------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, **kwargs) -> Tensor:
        return self.run(input_ids, **kwargs).logits

    def run(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        cache: StaticCache | None = None,
        cache_index: Tensor | None = None,
        attn_mask: Tensor | None = None,
        aux_layer_ids: Sequence[int] = (),
        logits_index: Tensor | None = None,
        compute_logits: bool = True,
    ) -> TargetOutput:
        """One forward over input_ids [B, T].

        positions: absolute positions [B, T] (default 0..T-1, or cache_index with a cache).
        cache/cache_index: write each token's cache entry at slot cache_index[b, t] and attend
            over the first S slots, S = attn_mask.shape[-1] (default: every slot <= own slot).
        attn_mask: [B, T, S] bool, True where query t may attend key s (tree verify passes one).
            With a cache, a token may see no slot past the highest slot its row writes in this
            forward (every mask draftsman builds): on CUDA attention reads only the slots below
            it (layers.attention_limit), however large S.
        aux_layer_ids: capture the residual stream entering these layers (id L = output of
            the last layer, before the final norm), per DESIGN.md.
        logits_index: [B, K] positions whose logits to compute (default: all)."""
        positions, cache_index, attn_mask = resolve_slots(input_ids, positions, cache is not None,
                                                          cache_index, attn_mask)
        self._check_aux_ids(aux_layer_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        ctx = AttnContext(cos, sin, attn_mask, cache, cache_index, attention_limit(cache, cache_index))
        captured: dict[int, Tensor] = {}
        wanted = set(aux_layer_ids)
        for i, layer in enumerate(self.layers):
            if i in wanted:
                captured[i] = x
            x = layer(x, ctx, i)
        if len(self.layers) in wanted:
            captured[len(self.layers)] = x
        hidden = self.norm(x)
        logits = None
        if compute_logits:
            h = hidden if logits_index is None else _gather_rows(hidden, logits_index)
            logits = self.lm_head(h)
        return TargetOutput(logits, [captured[i] for i in aux_layer_ids], hidden)

    def _check_aux_ids(self, ids: Sequence[int]) -> None:
        n = len(self.layers)
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range for a {n}-layer target (valid: 0..{n})")

    # ---- checkpoints --------------------------------------------------------------------
    @abstractmethod
    def checkpoint_name(self, name: str) -> tuple[str, int | None] | str | None:
        """Map a checkpoint tensor name to (parameter, stacked index | None), SKIP or None."""



def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    return x.gather(1, index[..., None].expand(*index.shape, x.shape[-1]))
