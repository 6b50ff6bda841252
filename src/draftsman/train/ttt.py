"""Training-time test (TTT) for EAGLE-3 drafters: the unrolled multi-step forward, the teacher
targets and the loss, as pure functions over tensors (the trainer wires them to data and
optimisers; `TTTModel` bundles them into one module so DDP/FSDP see one forward per micro-batch).

Index math. Sequence x_0..x_{T-1}; target feature f_t = the aux states at position t; target
logits L_t = the target's distribution of x_{t+1}.

  pair t = (token x_{t+1}, feature f_t) sits at position t and predicts x_{t+2}.
  TTT step k = 0..K-1 at index t:
    input token    x_{t+k+1}
    hidden input   fc(f_t) at k = 0, else the drafter's own un-normed output of step k-1 at index t
    predicts       x_{t+k+2}; target distribution = softmax(L_{t+k+1}) renormalised over the
                   draft vocabulary
    query position t+k; the step-k key/value at index t is stored with position t+k
    attends        the step-0 keys at indices s <= t (causal over true features) and the keys of
                   steps 1..k at index t only ("each later step sees its own position only").
  That is exactly what a chain node sees at inference (spec/engine.py): with pairs 0..n-1
  committed, the depth-d draft (d = k+1) sits at position n+d-1 = t+k for t = n-1 and attends
  the committed slots plus its ancestors (the earlier steps at the same index).
  Mask of step k at index t: loss_mask[x_{t+k+2}] (an assistant token is predicted) AND
  t2d[argmax L_{t+k+1}] (the target's choice lies in the draft vocabulary: SpecForge's position
  mask). Shifted inputs that run past the sequence are padded at the end and masked; since every
  key a query sees sits at an index <= its own, end padding never leaks into real positions.
  Step k is weighted decay^k (0.8^k) and averaged over its masked positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsman.models.eagle3 import Eagle3Attention, Eagle3Drafter, Eagle3Layer
from draftsman.models.layers import apply_rotary, attention

__all__ = [
    "DEFAULT_DECAY",
    "StepTerms",
    "TTTModel",
    "Teacher",
    "chain_acceptance",
    "predicted_tau",
    "shift_left",
    "step_mask",
    "step_terms",
    "step_weights",
    "teacher_from_hidden",
    "teacher_from_logits",
    "ttt_attention_mask",
    "ttt_forward",
    "ttt_objective",
]

DEFAULT_DECAY = 0.8


def step_weights(steps: int, decay: float = DEFAULT_DECAY) -> list[float]:
    return [decay**k for k in range(steps)]


def shift_left(x: Tensor, n: int, fill: float | int | bool = 0) -> Tensor:
    """out[:, t] = x[:, t + n] along dim 1, `fill` where t + n runs past the end."""
    if n == 0:
        return x
    n = min(n, x.shape[1])
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


# ---- forward ------------------------------------------------------------------------------------
def ttt_attention_mask(seq_len: int, step: int, device: torch.device | str | None = None) -> Tensor:
    """[T, (step+1)*T] bool over the keys of steps 0..step concatenated: causal over the step-0
    keys, then only the same index among each later step's keys."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * step)], dim=1)


def ttt_attention(attn: Eagle3Attention, x: Tensor, cos: Tensor, sin: Tensor,
                  past: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
    """The drafter's attention with per-step K/V concatenated instead of a static cache. Appends
    this step's (k, v) to `past` (rotated at this step's positions)."""
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, attn.n_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, t, attn.n_kv, attn.head_dim)
    v = attn.v_proj(x).view(b, t, attn.n_kv, attn.head_dim)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    past.append((k, v))
    keys = torch.cat([kv[0] for kv in past], 1) if len(past) > 1 else k
    values = torch.cat([kv[1] for kv in past], 1) if len(past) > 1 else v
    if attn.n_kv != attn.n_heads:  # expand GQA heads so CUDA can pick a masked fused kernel
        keys = keys.repeat_interleave(attn.n_heads // attn.n_kv, dim=2)
        values = values.repeat_interleave(attn.n_heads // attn.n_kv, dim=2)
    out = attention(q, keys, values, mask.expand(b, -1, -1), attn.scale)
    return attn.o_proj(out.reshape(b, t, -1))


def ttt_layer(layer: Eagle3Layer, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
              past: list[tuple[Tensor, Tensor]], mask: Tensor) -> Tensor:
    """Eagle3Layer.forward with `ttt_attention` in place of the cached attention."""
    normed = layer.hidden_norm(hidden)
    residual = normed if layer.norm_before_residual else hidden
    x = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
    x = residual + ttt_attention(layer.self_attn, x, cos, sin, past, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def ttt_forward(drafter: Eagle3Drafter, input_ids: Tensor, hidden: Tensor, steps: int) -> Iterator[Tensor]:
    """Yield the draft-vocabulary logits [B, T, Vd] of TTT steps 0..steps-1.

    input_ids [B, T]: the sequence x (right-padded); hidden [B, T, H]: fc(aux states), i.e.
    `drafter.project(aux)`. Logits of step k at index t predict x_{t+k+2} (module docstring).
    A generator, so a caller can reduce each step's logits to a loss before the next is made."""
    b, t = input_ids.shape
    dtype = drafter.fc.weight.dtype
    base = torch.arange(t, device=input_ids.device).expand(b, t)
    past: list[tuple[Tensor, Tensor]] = []
    for k in range(steps):
        embeds = drafter.embed(shift_left(input_ids, k + 1)).to(dtype)
        cos, sin = drafter.rotary(base + k, dtype)
        mask = ttt_attention_mask(t, k, input_ids.device)
        hidden = ttt_layer(drafter.midlayer, embeds, hidden, cos, sin, past, mask)
        yield drafter.compute_logits(hidden)


# ---- teacher ------------------------------------------------------------------------------------
@dataclass
class Teacher:
    """The target's next-token distribution at every position t (it predicts x_{t+1})."""

    probs: Tensor  # [B, T, Vd] float32: softmax of the target logits restricted to the draft vocab
    token: Tensor  # [B, T] int64: the target's argmax over the FULL vocabulary


def teacher_from_logits(logits: Tensor, draft_token_ids: Tensor) -> Teacher:
    """From full-vocabulary target logits [B, T, V]."""
    return Teacher(logits[..., draft_token_ids].float().softmax(-1), logits.argmax(-1))


def full_argmax(hidden: Tensor, lm_head_weight: Tensor, chunk: int = 1024) -> Tensor:
    """argmax of hidden @ W^T over the full vocabulary, `chunk` rows at a time (the full logits of
    a long sequence and a 100k+ vocabulary would not fit at once)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = [F.linear(flat[i : i + chunk].to(lm_head_weight.dtype), lm_head_weight).argmax(-1)
           for i in range(0, flat.shape[0], chunk)]
    return torch.cat(out).view(hidden.shape[:-1])


def draft_logits_from_hidden(hidden: Tensor, lm_head_weight: Tensor, draft_token_ids: Tensor) -> Tensor:
    """The target's logits over the draft vocabulary only: W[draft ids] @ h."""
    return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight[draft_token_ids])


def teacher_from_hidden(hidden: Tensor, lm_head_weight: Tensor, draft_token_ids: Tensor) -> Teacher:
    """From the target's final normed hidden states [B, T, H] and its lm_head weight [V, H]."""
    probs = draft_logits_from_hidden(hidden, lm_head_weight, draft_token_ids).float().softmax(-1)
    return Teacher(probs, full_argmax(hidden, lm_head_weight))


# ---- loss ---------------------------------------------------------------------------------------
@dataclass
class StepTerms:
    """Per-step sums over a batch, each [K]; divide by the (global) counts to average."""

    loss_sum: Tensor  # masked sum of the soft cross-entropy (differentiable)
    count: Tensor  # masked positions
    correct: Tensor  # masked positions where the drafter's top-1 equals the target's


def step_mask(loss_mask: Tensor, token: Tensor, t2d: Tensor | None, k: int) -> Tensor:
    """[B, T] bool mask of step k: loss_mask at the predicted token x_{t+k+2}, and (given t2d)
    the target's full-vocabulary argmax at t+k+1 inside the draft vocabulary."""
    mask = shift_left(loss_mask.bool(), k + 2, False)
    if t2d is not None:
        mask = mask & shift_left(t2d[token], k + 1, False)
    return mask


def step_terms(logits: Tensor, teacher: Teacher, loss_mask: Tensor, draft_token_ids: Tensor,
               t2d: Tensor | None, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Loss sum, count and correct count of step k, plus the per-position mask and hits [B, T].

    Soft cross-entropy between log_softmax(draft logits) and the teacher's draft-vocabulary
    distribution at t+k+1. `t2d=None` drops the position mask (evaluation: a target choice
    outside the draft vocabulary then counts as a miss, as it would at inference)."""
    t = loss_mask.shape[1]
    mask = step_mask(loss_mask, teacher.token, t2d, k)
    n = t - k - 1  # indices whose target position t+k+1 exists; the rest are masked anyway
    hits = torch.zeros_like(mask)
    if n <= 0:
        zero = logits.sum() * 0
        return zero, mask.sum(), hits.sum(), mask, hits
    logp = F.log_softmax(logits[:, :n].float(), -1)
    ce = -(teacher.probs[:, k + 1 :] * logp).sum(-1)
    m = mask[:, :n]
    loss_sum = torch.where(m, ce, 0.0).sum()
    with torch.no_grad():
        pred = draft_token_ids[logits[:, :n].argmax(-1)]
        hits[:, :n] = (pred == teacher.token[:, k + 1 :]) & m
    return loss_sum, mask.sum(), hits.sum(), mask, hits


def ttt_objective(loss_sum: Tensor, count: Tensor, weights: Sequence[float] | Tensor) -> Tensor:
    """sum_k w_k * loss_sum_k / count_k: each step averaged over its masked positions."""
    w = torch.as_tensor(weights, dtype=loss_sum.dtype, device=loss_sum.device)
    return (w * loss_sum / count.to(loss_sum.dtype).clamp(min=1)).sum()


# ---- acceptance ---------------------------------------------------------------------------------
def predicted_tau(acceptance: Sequence[float]) -> float:
    """tau = 1 + sum_k prod_{j<=k} a_j for a chain, ASSUMING the teacher-forced per-step rates a_j
    are independent (step k's hit rate measured on all positions stands in for its rate given
    that steps < k were accepted)."""
    tau, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        tau += run
    return tau


def chain_acceptance(masks: Sequence[Tensor], hits: Sequence[Tensor]) -> tuple[list[int], list[int]]:
    """Joint chain acceptance without the independence assumption: for depth k, over indices
    where steps 0..k are all masked in, how many have steps 0..k all correct. Returns
    (accepted counts, position counts) per depth."""
    accepted, counted = [], []
    all_mask = all_hit = None
    for m, h in zip(masks, hits, strict=True):
        all_mask = m if all_mask is None else all_mask & m
        all_hit = h if all_hit is None else all_hit & h
        counted.append(int(all_mask.sum()))
        accepted.append(int((all_hit & all_mask).sum()))
    return accepted, counted


# ---- the module DDP / FSDP wrap -------------------------------------------------------------------
class TTTModel(nn.Module):
    """The drafter unrolled over `steps` TTT steps. forward -> StepTerms summed over the batch.

    One module owns the drafter's parameters so a distributed wrapper sees one forward per
    micro-batch (calling the drafter's submodules directly inside is then safe)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int) -> None:
        super().__init__()
        if steps < 1:
            raise ValueError(f"TTT steps must be >= 1, got {steps}")
        self.drafter, self.steps = drafter, steps

    def forward(self, input_ids: Tensor, aux_hidden: Tensor, loss_mask: Tensor, probs: Tensor,
                token: Tensor, position_mask: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        d = self.drafter
        teacher = Teacher(probs, token)
        t2d = d.t2d if position_mask else None
        draft_ids = d.draft_token_ids
        hidden = d.project(aux_hidden)
        sums, counts, correct = [], [], []
        for k, logits in enumerate(ttt_forward(d, input_ids, hidden, self.steps)):
            s, c, h, _, _ = step_terms(logits, teacher, loss_mask, draft_ids, t2d, k)
            sums.append(s)
            counts.append(c)
            correct.append(h)
        return torch.stack(sums), torch.stack(counts), torch.stack(correct)
