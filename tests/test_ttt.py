"""TTT: the batched training forward equals a literal per-index reference and the inference
engine's chain drafting; the loss masks and step weights are what the docstring says."""

from __future__ import annotations

import math

import pytest
import torch

import draftsman
from draftsman.models.eagle3 import init_drafter
from draftsman.train.ttt import (
    Teacher,
    TTTModel,
    chain_acceptance,
    predicted_tau,
    shift_left,
    step_mask,
    step_terms,
    step_weights,
    teacher_from_hidden,
    teacher_from_logits,
    ttt_attention_mask,
    ttt_forward,
    ttt_objective,
)

STEPS = 4


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return draftsman.load_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def drafter(target):
    # A draft vocabulary that leaves some target ids out, so t2d matters.
    ids = torch.arange(0, 256, 2)
    d = init_drafter(target, draft_vocab_size=128, draft_token_ids=ids, seed=3, std=0.2)
    return d.requires_grad_(False)


def _features(target, drafter, ids):
    with torch.no_grad():
        out = target.run(ids, aux_layer_ids=drafter.aux_layer_ids)
    return out, torch.cat(out.aux_hidden, -1)


# ---- literal reference ----------------------------------------------------------------------------
def _rot(x, pos, drafter):
    """Rotate one vector per head [H, D] at a scalar position."""
    cos, sin = drafter.rotary(torch.tensor([[pos]]), x.dtype)
    return draftsman.models.layers.apply_rotary(x[None, None], cos, sin)[0, 0]


def _layer_input(drafter, token, h):
    lay = drafter.midlayer
    return torch.cat([lay.input_layernorm(drafter.embed(torch.tensor([token]))[0]), lay.hidden_norm(h)])


def _layer_rest(drafter, h, x_in, keys, values, q):
    """Residual + naive softmax attention over the given keys + MLP."""
    lay, att = drafter.midlayer, drafter.midlayer.self_attn
    rep = att.n_heads // att.n_kv
    k = torch.stack(keys).repeat_interleave(rep, dim=1)  # [S, H, D]
    v = torch.stack(values).repeat_interleave(rep, dim=1)
    w = torch.einsum("hd,shd->hs", q, k) * att.scale
    out = torch.einsum("hs,shd->hd", w.softmax(-1), v).reshape(-1)
    residual = lay.hidden_norm(h) if lay.norm_before_residual else h
    x = residual + att.o_proj(out)
    return x + lay.mlp(lay.post_attention_layernorm(x))


def reference_step_logits(drafter, ids: list[int], feats: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Steps 0..steps-1 at index t, the most literal way: step k reads token x_{t+k+1} at position
    t+k, attends the step-0 keys of indices 0..t and its own earlier steps' keys at index t."""
    att = drafter.midlayer.self_attn
    heads = (att.n_heads, att.head_dim)
    kv = (att.n_kv, att.head_dim)
    keys0, values0 = [], []
    for s in range(t + 1):  # step-0 keys: pair s = (x_{s+1}, f_s) at position s
        x = _layer_input(drafter, ids[s + 1], drafter.fc(feats[s]))
        keys0.append(_rot(att.k_proj(x).view(kv), s, drafter))
        values0.append(att.v_proj(x).view(kv))
    h = drafter.fc(feats[t])
    own_k, own_v, logits = [], [], []
    for k in range(steps):
        x = _layer_input(drafter, ids[t + k + 1], h)
        q = _rot(att.q_proj(x).view(heads), t + k, drafter)
        if k > 0:
            own_k.append(_rot(att.k_proj(x).view(kv), t + k, drafter))
            own_v.append(att.v_proj(x).view(kv))
        h = _layer_rest(drafter, h, x, keys0 + own_k, values0 + own_v, q)
        logits.append(drafter.compute_logits(h))
    return logits


def test_ttt_forward_matches_literal_reference(target, drafter):
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (2, 14))
    _, aux = _features(target, drafter, ids)
    with torch.no_grad():
        batched = list(ttt_forward(drafter, ids, drafter.project(aux), STEPS))
        for row in range(2):
            for t in (0, 3, 14 - STEPS - 1):
                ref = reference_step_logits(drafter, ids[row].tolist(), aux[row], t, STEPS)
                for k in range(STEPS):  # (fp32, batched against per-position sums: 1.3e-5 seen on one CPU)
                    torch.testing.assert_close(batched[k][row, t], ref[k], atol=5e-5, rtol=1e-4)


def test_ttt_loss_matches_literal_reference(target, drafter):
    torch.manual_seed(2)
    ids = torch.randint(3, 256, (1, 12))
    loss_mask = torch.tensor([[0] * 4 + [1] * 8])
    out, aux = _features(target, drafter, ids)
    teacher = teacher_from_logits(out.logits, drafter.draft_token_ids)
    model = TTTModel(drafter, STEPS)
    with torch.no_grad():
        sums, counts, correct = model(ids, aux, loss_mask, teacher.probs, teacher.token)
    ids_l, full = ids[0].tolist(), out.logits[0]
    draft_ids = drafter.draft_token_ids
    for k in range(STEPS):
        ref_sum, ref_n, ref_hit = 0.0, 0, 0
        for t in range(12):
            if t + k + 2 >= 12 or not loss_mask[0, t + k + 2]:
                continue
            target_logits = full[t + k + 1]
            if not drafter.t2d[target_logits.argmax()]:
                continue
            ref = reference_step_logits(drafter, ids_l, aux[0], t, k + 1)[k]
            p = target_logits[draft_ids].softmax(-1)
            ref_sum += float(-(p * ref.log_softmax(-1)).sum())
            ref_n += 1
            ref_hit += int(draft_ids[ref.argmax()] == target_logits.argmax())
        assert int(counts[k]) == ref_n
        assert int(correct[k]) == ref_hit
        assert math.isclose(float(sums[k]), ref_sum, rel_tol=1e-5, abs_tol=1e-5)
    assert int(counts[0]) > 0


# ---- consistency with inference ---------------------------------------------------------------------
def test_ttt_step_logits_equal_engine_chain_drafting(target, drafter):
    """Step-k logits at index t equal what the engine computes for the depth-(k+1) chain node when
    pairs 0..t are committed and the chain follows the true tokens: drafter.forward over the
    prefix into a static cache, then one node per step at position t+k in scratch slot t+k with
    the engine's own mask builder."""
    torch.manual_seed(4)
    ids = torch.randint(3, 256, (1, 16))
    _, aux = _features(target, drafter, ids)
    with torch.no_grad():
        ttt = list(ttt_forward(drafter, ids, drafter.project(aux), STEPS))
        for t in (2, 9):
            n = t + 1  # committed pairs 0..t
            cache = drafter.new_cache(1, 32)
            pos = torch.arange(n)[None]
            logits, h = drafter(ids[:, 1 : n + 1], drafter.project(aux[:, :n]), pos, cache=cache, cache_index=pos)
            torch.testing.assert_close(logits[0, t], ttt[0][0, t], atol=1e-5, rtol=1e-5)
            hidden = h[:, t]
            for k in range(1, STEPS):
                # engine layout (spec/engine.py): committed slots [0, n), then scratch slot n+d-1
                # for the depth-d chain node; the node sees the committed slots and its ancestors
                mask = (torch.arange(n + k) < n + k)[None, None]
                token = ids[:, t + k + 1 : t + k + 2]
                logits, h = drafter(token, hidden[:, None], torch.tensor([[n + k - 1]]), cache=cache,
                                    cache_index=torch.tensor([[n + k - 1]]), attn_mask=mask)
                torch.testing.assert_close(logits[0, 0], ttt[k][0, t], atol=1e-5, rtol=1e-5)
                hidden = h[:, 0]


# ---- masks, weights, teacher --------------------------------------------------------------------
def test_attention_mask_layout():
    m = ttt_attention_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert m[:, 3:6].equal(torch.eye(3, dtype=torch.bool)) and m[:, 6:].equal(torch.eye(3, dtype=torch.bool))


def test_shift_left_pads_at_the_end():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 2, -1).tolist() == [[3, 4, -1, -1]]
    assert shift_left(x, 9, 0).tolist() == [[0, 0, 0, 0]]


def test_step_mask_loss_mask_and_t2d():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1]])
    t2d = torch.tensor([True, False, True])
    token = torch.tensor([[0, 1, 2, 0, 1, 2, 0]])  # target argmax at each position
    # step 0 at index t: loss_mask[t+2] and t2d[token[t+1]]
    m0 = step_mask(loss_mask, token, None, 0)
    assert m0.long().tolist() == [[1, 1, 1, 0, 1, 0, 0]]
    m0 = step_mask(loss_mask, token, t2d, 0)
    assert m0.long().tolist() == [[0, 1, 1, 0, 1, 0, 0]]  # t=0: token[1]=1 is not drafted
    m1 = step_mask(loss_mask, token, t2d, 1)  # loss_mask[t+3], t2d[token[t+2]]
    assert m1.long().tolist() == [[1, 1, 0, 1, 0, 0, 0]]


def test_masked_positions_carry_no_loss_or_gradient():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 4, requires_grad=True)
    teacher = Teacher(torch.randn(1, 6, 4).softmax(-1), torch.tensor([[0, 1, 2, 3, 0, 1]]))
    loss_mask = torch.tensor([[0, 0, 1, 0, 1, 1]])
    t2d = torch.tensor([True, True, False, True])
    s, c, _, mask, _ = step_terms(logits, teacher, loss_mask, torch.arange(4), t2d, 0)
    # t=1: loss_mask[3] = 0; t=4, 5: past the end; t=0, 2, 3: t2d[token[t+1]] holds
    assert mask.long().tolist() == [[1, 0, 1, 1, 0, 0]]
    assert int(c) == 3
    s.backward()
    grad_rows = logits.grad[0].abs().sum(-1) > 0
    assert grad_rows.tolist() == mask[0].tolist()
    ref = sum(float(-(teacher.probs[0, t + 1] * logits.detach()[0, t].log_softmax(-1)).sum()) for t in (0, 2, 3))
    assert math.isclose(float(s.detach()), ref, rel_tol=1e-6)


def test_step_weights_and_objective():
    assert step_weights(4) == pytest.approx([1, 0.8, 0.64, 0.512])
    loss = ttt_objective(torch.tensor([2.0, 4.0, 9.0]), torch.tensor([2, 4, 0]), step_weights(3))
    assert float(loss) == pytest.approx(1.0 + 0.8 * 1.0 + 0.64 * 9.0)  # empty step: count clamps to 1


def test_teacher_from_hidden_equals_from_logits(target, drafter):
    ids = torch.randint(3, 256, (2, 9))
    out, _ = _features(target, drafter, ids)
    a = teacher_from_logits(out.logits, drafter.draft_token_ids)
    b = teacher_from_hidden(out.hidden, target.lm_head.weight, drafter.draft_token_ids)
    torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=1e-5)
    assert a.token.equal(b.token)
    assert torch.allclose(a.probs.sum(-1), torch.ones(2, 9))


def test_predicted_tau_and_chain_acceptance():
    assert predicted_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    masks = [torch.tensor([True, True, True, False]), torch.tensor([True, True, False, False])]
    hits = [torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False])]
    assert chain_acceptance(masks, hits) == ([2, 1], [3, 2])


def test_ttt_backward_reaches_every_parameter(target, drafter):
    d = init_drafter(target, draft_vocab_size=128, draft_token_ids=torch.arange(0, 256, 2), seed=0)
    ids = torch.randint(3, 256, (2, 10))
    out, aux = _features(target, d, ids)
    teacher = teacher_from_logits(out.logits, d.draft_token_ids)
    sums, counts, _ = TTTModel(d, 3)(ids, aux, torch.ones_like(ids), teacher.probs, teacher.token,
                                     position_mask=False)
    ttt_objective(sums, counts, step_weights(3)).backward()
    missing = [n for n, p in d.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
