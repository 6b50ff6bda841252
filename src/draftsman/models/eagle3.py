"""The EAGLE-3 drafter: one Llama decoder layer over cat(embed(token), fc(aux states)), its
checkpoint I/O (the `LlamaForCausalLMEagle3` layout SGLang, vLLM and SafeAILab/EAGLE load) and a
random-init factory.

Per draft step t (DESIGN.md):
    x   = cat(input_layernorm(embed(token_{t+1})), hidden_norm(h_t))     # embedding first, 2H wide
    h'  = h_t + o_proj(attn(q/k/v_proj(x)))                              # residual: the un-normed h
    h'' = h' + mlp(post_attention_layernorm(h'))                         # fed back as h_{t+1}
    logits = lm_head(norm(h''))                                          # over the draft vocabulary
with h_0 = fc(cat(aux_0, aux_1, aux_2)) from the target's residual stream. The token embedding is
the target's (shared, never stored), unless the drafter is narrower than the target, in which case
the checkpoint must carry its own `embed_tokens.weight` (as SGLang and SafeAILab/EAGLE do)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from draftsman.config import DrafterConfig, parse_drafter_config
from draftsman.kvcache import StaticCache
from draftsman.models.base import AttnContext, TargetModel
from draftsman.models.layers import (
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rotary,
    attention,
    attention_limit,
    fuse_projections,
    fuse_qkv,
    project_qkv,
    resolve_slots,
)
from draftsman.weights import (
    CheckpointError,
    build_empty,
    save_safetensors,
)

__all__ = ["Eagle3Drafter", "init_drafter", "load_drafter", "save_drafter"]

EMBED_NAMES = ("embed_tokens.weight", "model.embed_tokens.weight")


class Eagle3Attention(nn.Module):
    """GQA attention whose q/k/v read the 2H-wide cat(embedding, hidden)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def fuse(self) -> None:
        """One GEMM for q, k and v (inference; load_drafter(inference=True))."""
        fuse_qkv(self)

    def kernel_heads(self) -> tuple[int, int, int, int]:
        """(query heads, KV heads, key width, value width): layers.decode_kernel_serves."""
        return self.n_heads, self.n_kv, self.head_dim, self.head_dim

    def forward(self, x: Tensor, ctx: AttnContext) -> Tensor:
        b, t, _ = x.shape
        q, k, v = project_qkv(self, x)
        q = q.view(b, t, self.n_heads, self.head_dim)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        q, k = apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write(0, ctx.cache_index, k=k, v=v)
            s = ctx.mask.shape[-1]
            k, v = ctx.cache.read(0, "k", s), ctx.cache.read(0, "v", s)
        out = attention(q, k, v, ctx.mask, self.scale, limit=ctx.limit)
        return self.o_proj(out.reshape(b, t, -1))


class Eagle3Layer(nn.Module):
    """The `midlayer`: tensor names as in the published checkpoints."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds: Tensor, hidden: Tensor, ctx: AttnContext) -> Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = residual + self.self_attn(x, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. Bind it to its target (`bind_target`) before `forward`: the target supplies
    the token embedding and the default aux layer ids.

    Buffers: `d2t` [draft_vocab] int64 offsets (target_id = draft_id + d2t[draft_id]) and `t2d`
    [vocab] bool (True where a target id is in the draft vocabulary)."""

    def __init__(self, config: DrafterConfig, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(config.rope, config.head_dim, config.max_position_embeddings)
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.aux_layer_ids: tuple[int, ...] | None = config.aux_layer_ids
        self.layer_ids_source: str = config.layer_ids_source
        self.notes: list[str] = []  # what loading tolerated or filled in (skipped tensors, defaults)
        object.__setattr__(self, "_target", None)  # a plain reference: not a submodule, never saved

    # ---- target binding -----------------------------------------------------------------
    @property
    def target(self) -> TargetModel | None:
        return self._target

    @property
    def has_own_embedding(self) -> bool:
        return "embed_tokens" in self._modules

    def bind_target(self, target: TargetModel) -> Eagle3Drafter:
        """Validate against `target`, share its embedding and resolve the aux layer ids."""
        validate_drafter(self, target)
        object.__setattr__(self, "_target", target)
        if self.config.aux_layer_ids is None:
            self.aux_layer_ids = tuple(target.config.default_aux_layer_ids())
            self.layer_ids_source = (
                f"default: [2, L//2, L-3] from the {target.config.num_hidden_layers}-layer target "
                f"= {list(self.aux_layer_ids)}"
            )
        return self

    def embed(self, input_ids: Tensor) -> Tensor:
        if self.has_own_embedding:
            return self.embed_tokens(input_ids)
        if self._target is None:
            raise RuntimeError(
                "the drafter shares its target's token embedding: call drafter.bind_target(target) "
                "(or load_drafter(path, target=...)) first"
            )
        return self._target.embed_tokens(input_ids)

    # ---- vocabulary mapping -------------------------------------------------------------
    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (target_id = draft_id + d2t[draft_id])."""
        return draft_ids + self.d2t[draft_ids]

    @property
    def draft_token_ids(self) -> Tensor:
        """[draft_vocab] target id of every draft row (SGLang's `hot_token_id`)."""
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    @property
    def target_logits_mask(self) -> Tensor:
        """[vocab] bool: target ids the drafter can propose (t2d)."""
        return self.t2d

    def to_target_logits(self, draft_logits: Tensor) -> Tensor:
        """[..., draft_vocab] -> [..., vocab] with -inf outside the draft vocabulary (as vLLM does)."""
        if self.config.full_vocab and not bool(self.d2t.any()):
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_token_ids] = draft_logits
        return out

    def set_vocab_mapping(self, draft_token_ids: Tensor | Sequence[int]) -> None:
        """Set d2t/t2d from the target ids of the draft rows (ascending, as SpecForge builds them)."""
        ids = torch.as_tensor(draft_token_ids, dtype=torch.int64, device=self.d2t.device)
        if ids.shape != (self.config.draft_vocab_size,):
            raise ValueError(
                f"draft_token_ids has shape {list(ids.shape)}, expected [{self.config.draft_vocab_size}]"
            )
        d2t = ids - torch.arange(ids.numel(), device=ids.device)
        t2d = torch.zeros_like(self.t2d)
        t2d[ids.clamp(0, self.config.vocab_size - 1)] = True
        check_vocab_mapping(d2t, t2d, self.config.vocab_size, "set_vocab_mapping")
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    # ---- forward ------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> StaticCache:
        kv = (self.config.num_key_value_heads, self.config.head_dim)
        return StaticCache.allocate(
            {"k": kv, "v": kv}, 1, batch_size, max_len,
            device=self.fc.weight.device, dtype=dtype or self.fc.weight.dtype,
        )

    def project(self, aux_hidden: Sequence[Tensor] | Tensor) -> Tensor:
        """fc over cat(aux states, dim=-1): [B, T, 3*H_target] -> [B, T, H]."""
        x = torch.cat(list(aux_hidden), dim=-1) if not isinstance(aux_hidden, Tensor) else aux_hidden
        if x.shape[-1] != self.config.fc_in_features:
            raise ValueError(
                f"aux hidden states are {x.shape[-1]} wide, but the drafter's fc expects "
                f"3 x target_hidden_size = {self.config.fc_in_features}"
            )
        return self.fc(x.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor | None = None,
        cache: StaticCache | None = None,
        cache_index: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One drafter pass over TARGET token ids [B, T] and hidden states [B, T, H].

        Same conventions as TargetModel.run: without a cache, causal attention over the T tokens;
        with one, each token's k/v is written at slot cache_index[b, t] (default: positions) and it
        attends over the first S = attn_mask.shape[-1] slots (default: slots <= its own).
        Returns (draft-vocabulary logits [B, T, draft_vocab], un-normed hidden out [B, T, H])."""
        positions, cache_index, attn_mask = resolve_slots(input_ids, positions, cache is not None,
                                                          cache_index, attn_mask)
        dtype = self.fc.weight.dtype
        embeds = self.embed(input_ids).to(dtype)
        cos, sin = self.rotary(positions, dtype)
        ctx = AttnContext(cos, sin, attn_mask, cache, cache_index, attention_limit(cache, cache_index))
        out = self.midlayer(embeds, hidden.to(dtype), ctx)
        return self.compute_logits(out), out

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))



# ---- validation ---------------------------------------------------------------------------------
def check_vocab_mapping(d2t: Tensor, t2d: Tensor, vocab_size: int, source: str) -> None:
    """d2t maps every draft id into the target vocabulary, injectively; t2d marks exactly those ids."""
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    bad = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        shown = [(int(i), int(target_ids[i])) for i in bad[:5]]
        raise ValueError(
            f"{source}: d2t maps {bad.numel()} draft ids outside the target vocabulary 0..{vocab_size - 1} "
            f"(draft id -> target id: {shown})"
        )
    uniq, counts = torch.unique(target_ids, return_counts=True)
    if bool((counts > 1).any()):
        dup = uniq[counts > 1][:5]
        shown = {int(v): (target_ids == v).nonzero().flatten().tolist()[:5] for v in dup}
        raise ValueError(
            f"{source}: d2t has duplicates: several draft ids map to the same target id "
            f"(target id: draft ids {shown})"
        )
    if t2d.numel() != vocab_size:
        raise ValueError(f"{source}: t2d has {t2d.numel()} entries but vocab_size={vocab_size}")
    expected = torch.zeros(vocab_size, dtype=torch.bool, device=t2d.device)
    expected[target_ids.to(t2d.device)] = True
    if not torch.equal(expected, t2d.bool()):
        missing = (expected & ~t2d.bool()).nonzero().flatten()[:5].tolist()
        extra = (~expected & t2d.bool()).nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"{source}: t2d is inconsistent with d2t: t2d has {int(t2d.sum())} True entries for "
            f"{d2t.numel()} draft ids; False at mapped target ids {missing}, True at unmapped ids {extra}"
        )


def validate_drafter(drafter: Eagle3Drafter, target: TargetModel) -> None:
    """Raise ValueError naming the fields when the drafter cannot run on `target`."""
    _check_config_fits(drafter.config, target, drafter.has_own_embedding)
    check_vocab_mapping(drafter.d2t, drafter.t2d, target.config.vocab_size, "drafter vocabulary mapping")


def _check_config_fits(cfg: DrafterConfig, target: TargetModel, own_embedding: bool) -> None:
    tcfg = target.config
    errors = []
    if cfg.target_hidden_size != tcfg.hidden_size:
        errors.append(
            f"drafter target_hidden_size={cfg.target_hidden_size} but target hidden_size={tcfg.hidden_size} "
            f"(fc input width {cfg.fc_in_features} != 3 x {tcfg.hidden_size})"
        )
    if cfg.vocab_size != tcfg.vocab_size:
        errors.append(f"drafter vocab_size={cfg.vocab_size} but target vocab_size={tcfg.vocab_size}")
    if not own_embedding and cfg.hidden_size != tcfg.hidden_size:
        errors.append(
            f"drafter hidden_size={cfg.hidden_size} differs from target hidden_size={tcfg.hidden_size}, "
            "so it cannot share the target's embedding, and it has no embed_tokens of its own"
        )
    n = tcfg.num_hidden_layers
    if cfg.aux_layer_ids is not None:
        bad = [i for i in cfg.aux_layer_ids if not 0 <= i <= n]
        if bad:
            errors.append(
                f"drafter aux layer ids {list(cfg.aux_layer_ids)} (from {cfg.layer_ids_source}) include "
                f"{bad}, out of range for a {n}-layer target (valid: 0..{n}, input of layer i)"
            )
    if errors:
        raise ValueError("drafter does not fit the target: " + "; ".join(errors))


# ---- checkpoint I/O -----------------------------------------------------------------------------
def _checkpoint_name(name: str, own_embedding: bool) -> str | None:
    """Checkpoint tensor name -> drafter parameter/buffer name; "" = skip; None = unexpected."""
    if name in EMBED_NAMES:
        return "embed_tokens.weight" if own_embedding else ""
    if name.endswith("rotary_emb.inv_freq"):
        return ""
    if name.startswith("layers.0."):  # speculators / vLLM-internal spelling of `midlayer.`
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def load_drafter(
    path: str | Path,
    target: TargetModel | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    layer_id_convention: str | None = None,
    draft_config: str | Path | None = None,
    inference: bool = False,
) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter (config.json + model.safetensors, sharded safetensors or
    pytorch_model.bin) written by draftsman, SGLang/SpecForge, vLLM, SafeAILab/EAGLE or
    `speculators`, or a SpecForge training state (`draft_config`: its draft config json).
    `source_format` records which (draftsman.interop.sources). With `target`, validate against
    it and bind to it. inference: frozen, with q/k/v and gate/up each fused into one GEMM (names
    and state_dict unchanged; not for training)."""
    from draftsman.interop.sources import resolve_drafter_source

    path = Path(path)
    source = resolve_drafter_source(path, draft_config)
    config = parse_drafter_config(source.raw_config, str(source.config_path), layer_id_convention)
    # A drafter narrower than its target cannot share the target's embedding: it carries its own.
    own_embedding = config.hidden_size != config.target_hidden_size
    if target is not None:  # fail on the config before reading any tensor
        _check_config_fits(config, target, own_embedding)
    model = build_empty(lambda: Eagle3Drafter(config, own_embedding), device, dtype)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    read_device = str(device) if torch.device(device).type == "cuda" else "cpu"
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, file, load in source.tensors(read_device):
        pname = _checkpoint_name(name, own_embedding)
        if pname == "":
            if name in EMBED_NAMES:
                model.notes.append(_embedding_note(name, file, load, target))
            continue
        if pname is None or pname not in targets:
            unexpected.append(f"{name} (in {file.name})")
            continue
        tensor, dest = load(), targets[pname]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(
                f"{file}: tensor '{name}' has shape {list(tensor.shape)}, but config.json implies "
                f"{list(dest.shape)} for '{pname}'"
            )
        with torch.no_grad():
            dest.copy_(tensor.to(device=dest.device, dtype=dest.dtype))
        loaded.add(pname)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors in drafter checkpoint: {unexpected[:20]}")
    _fill_missing(model, targets, loaded, path, target)
    check_vocab_mapping(model.d2t, model.t2d, config.vocab_size, str(path))
    model.source_format = source.format
    model.notes[:0] = [f"read as {source.format} ({config.layer_ids_source})", *source.notes]
    if target is not None:
        model.bind_target(target)
    model.source_dir = path
    model = model.eval()
    if inference:  # frozen, with q/k/v and gate/up fused (one GEMM each; names unchanged)
        fuse_projections(model.requires_grad_(False))
    return model


def _embedding_note(name: str, file: Path, load, target: TargetModel | None) -> str:
    note = f"skipped '{name}' in {file.name}: the drafter uses the target's embedding"
    if target is not None:
        theirs = load().to(target.embed_tokens.weight.device, torch.float32)
        ours = target.embed_tokens.weight.float()
        if theirs.shape != ours.shape:
            note += f" (checkpoint copy has shape {list(theirs.shape)}, target {list(ours.shape)})"
        else:
            diff = float((theirs - ours).abs().max())
            note += " (identical to the target's)" if diff == 0 else f" (differs from the target's: max |diff| {diff:.3g})"
    return note


def _fill_missing(
    model: Eagle3Drafter, targets: dict[str, Tensor], loaded: set[str], path: Path, target: TargetModel | None
) -> None:
    cfg = model.config
    with torch.no_grad():
        if "d2t" not in loaded and "t2d" in loaded:  # rebuild offsets from the mask (ascending ids)
            ids = model.t2d.nonzero().flatten()
            if ids.numel() != cfg.draft_vocab_size:
                raise CheckpointError(
                    f"{path}: 'd2t' is missing and t2d marks {ids.numel()} ids, not draft_vocab_size={cfg.draft_vocab_size}"
                )
            model.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            loaded.add("d2t")
            model.notes.append("'d2t' absent: rebuilt from t2d (draft ids in ascending target-id order)")
        if "d2t" not in loaded:
            if not cfg.full_vocab:
                raise CheckpointError(
                    f"{path}: missing tensor 'd2t' (the draft->target vocabulary map), required because "
                    f"draft_vocab_size={cfg.draft_vocab_size} != vocab_size={cfg.vocab_size}"
                )
            model.d2t.zero_()
            loaded.add("d2t")
            model.notes.append("'d2t' absent: identity mapping over the full vocabulary")
        if "t2d" not in loaded:
            model.t2d.zero_()
            model.t2d[torch.arange(cfg.draft_vocab_size, device=model.d2t.device) + model.d2t] = True
            loaded.add("t2d")
            model.notes.append("'t2d' absent: derived from d2t")
        if "lm_head.weight" not in loaded and cfg.full_vocab and target is not None \
                and tuple(target.lm_head.weight.shape) == tuple(model.lm_head.weight.shape):
            # SGLang loads the target's lm_head when a drafter has no draft_vocab_size (and no head).
            model.lm_head.weight.copy_(target.lm_head.weight)
            loaded.add("lm_head.weight")
            model.notes.append("'lm_head.weight' absent: copied the target's lm_head (full vocabulary)")
        if model.has_own_embedding and "embed_tokens.weight" not in loaded:
            raise CheckpointError(
                f"{path}: missing tensor 'embed_tokens.weight': the drafter's hidden_size={cfg.hidden_size} "
                f"differs from target_hidden_size={cfg.target_hidden_size}, so it cannot share the "
                "target's embedding and needs its own"
            )
    persistent = set(model.state_dict().keys())
    missing = sorted(n for n in targets if n in persistent and n not in loaded)
    if missing:
        raise CheckpointError(f"{path}: missing tensors in drafter checkpoint: {missing}")


def drafter_hf_config(drafter: Eagle3Drafter) -> dict[str, Any]:
    """The config.json that SGLang, vLLM, SpecForge and draftsman all read the same way."""
    cfg = drafter.config
    ids = drafter.aux_layer_ids
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": None if cfg.rope.type == "default" else cfg.rope.to_hf(),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if cfg.norm_before_residual:
        raw["norm_before_residual"] = True
    if ids is not None:
        # SGLang/SpecForge read eagle_config ids as "output of layer i" (+1 at capture); vLLM reads
        # the top-level key as "input of layer i"; the draftsman block is unambiguous.
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
        raw["eagle_aux_hidden_state_layer_ids"] = list(ids)
        raw["draftsman"] = {"aux_layer_ids": list(ids), "layer_id_convention": "input"}
    return raw


def save_drafter(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (official tensor names; no shared target tensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = drafter.state_dict()
    save_safetensors(state, out / "model.safetensors")
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(drafter_hf_config(drafter), indent=2) + "\n")
    tmp.replace(out / "config.json")
    return out


# ---- random init --------------------------------------------------------------------------------
def init_drafter(
    target: TargetModel,
    hidden_size: int | None = None,
    draft_vocab_size: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    draft_token_ids: Tensor | Sequence[int] | None = None,
    std: float = 0.02,
    seed: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> Eagle3Drafter:
    """A randomly initialised drafter shaped for `target` (defaults copy the target's geometry),
    bound to it. Vocabulary: full (identity) unless `draft_vocab_size` is smaller, in which case
    `draft_token_ids` (ascending target ids) or else the first `draft_vocab_size` ids."""
    tcfg = target.config
    hidden = hidden_size or tcfg.hidden_size
    if num_attention_heads is None:
        num_attention_heads = tcfg.num_attention_heads if hidden == tcfg.hidden_size else max(1, hidden // 64)
    if num_key_value_heads is None:
        num_key_value_heads = (
            tcfg.num_key_value_heads if num_attention_heads == tcfg.num_attention_heads else num_attention_heads
        )
    vocab = tcfg.vocab_size
    config = DrafterConfig(
        architecture="LlamaForCausalLMEagle3",
        hidden_size=hidden,
        intermediate_size=intermediate_size or (tcfg.intermediate_size if hidden == tcfg.hidden_size else 4 * hidden),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim or hidden // num_attention_heads,
        rms_norm_eps=tcfg.rms_norm_eps,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab,
        target_hidden_size=tcfg.hidden_size,
        max_position_embeddings=tcfg.max_position_embeddings,
        rope=tcfg.rope,
        aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else None,
        layer_ids_source="init_drafter(aux_layer_ids=...)" if aux_layer_ids is not None
        else "default: [2, L//2, L-3] from the target",
        layer_id_convention="input" if aux_layer_ids is not None else None,
    )
    weight = target.embed_tokens.weight
    device = device if device is not None else weight.device
    dtype = dtype or (weight.dtype if weight.is_floating_point() else torch.float32)
    drafter = build_empty(lambda: Eagle3Drafter(config, hidden != tcfg.hidden_size), device, dtype)
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                # Residual-branch outputs scaled down as in GPT-2 so h stays O(fc(aux)) at init.
                s = std / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
    if draft_token_ids is None:
        draft_token_ids = torch.arange(config.draft_vocab_size)
    drafter.set_vocab_mapping(draft_token_ids)
    return drafter.bind_target(target)
