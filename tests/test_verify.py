"""Acceptance rules: exact greedy cases, a statistical losslessness test (with proof of power),
cross-checks between the two sampling implementations, and SpecStats."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn.functional import one_hot

from draftsman.sampling import sample, warp_probs
from draftsman.spec.verify import (
    PAD,
    AcceptResult,
    SpecStats,
    ancestor_mask,
    chain_parents,
    greedy_accept,
    sample_accept,
    tree_depth,
)

# ---------------------------------------------------------------------------------------------
# Tree helpers


def naive_ancestors(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = parents[j]
    return mask


def random_parents(batch: int, n: int, gen: torch.Generator) -> Tensor:
    """Random topologically ordered trees: parent of node n is uniform in [0, n)."""
    node = torch.arange(n)
    parents = (torch.rand(batch, n, generator=gen) * node).floor().long()
    parents[:, 0] = -1
    return parents


def test_tree_depth_and_ancestor_mask() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]])
    assert tree_depth(parents).tolist() == [[0, 1, 1, 2, 2, 2]]
    assert ancestor_mask(parents)[0].tolist() == naive_ancestors(parents[0].tolist())
    gen = torch.Generator().manual_seed(0)
    many = random_parents(50, 17, gen)
    mask = ancestor_mask(many)
    for b in range(50):
        assert mask[b].tolist() == naive_ancestors(many[b].tolist())
    torch.testing.assert_close(tree_depth(many), mask.sum(-1) - 1)
    chain = chain_parents(5)
    assert chain.tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree_depth(chain).tolist() == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------------------------
# Greedy: exact expected outputs on hand-built trees

V = 8


def logits_wanting(want: list[list[int]]) -> Tensor:
    """Target logits whose argmax at node n is want[b][n]."""
    return one_hot(torch.tensor(want), V).float() * 5 + 0.1


def test_greedy_chain_full_partial_zero() -> None:
    tokens = torch.tensor([[1, 3, 5, 2]] * 3)
    want = [
        [3, 5, 2, 7],  # every draft is the target's argmax: accept 3, bonus 7
        [3, 6, 2, 7],  # node 1 wants 6, draft was 5: accept 1, bonus 6
        [4, 5, 2, 7],  # root wants 4: accept 0, bonus 4
    ]
    res = greedy_accept(tokens, chain_parents(3), logits_wanting(want))
    assert res.accept_len.tolist() == [3, 1, 0]
    assert res.path.tolist() == [[0, 1, 2, 3], [0, 1, PAD, PAD], [0, PAD, PAD, PAD]]
    assert res.bonus.tolist() == [7, 6, 4]
    assert res.accepted_tokens.tolist() == [[3, 5, 2, 7], [3, 6, PAD, PAD], [4, PAD, PAD, PAD]]
    assert res.last_node.tolist() == [3, 1, 0]


def test_greedy_branching_tree_second_sibling_and_padding() -> None:
    #        0
    #      /   \
    #   1:3    2:4
    #    |     /  \
    #   3:6  4:1  5:2
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2]] * 3)
    tokens = torch.tensor([[0, 3, 4, 6, 1, 2]] * 3)
    want = [[4, 6, 2, 0, 0, 7]] * 3  # root -> 4 (node 2), node 2 -> 2 (node 5), node 5 -> 7
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[1, 5] = False  # the matching grandchild is padding: stop at node 2
    valid[2, 2] = False  # the matching child is padding (its subtree is unreachable)
    res = greedy_accept(tokens, parents, logits_wanting(want), valid)
    assert res.accept_len.tolist() == [2, 1, 0]
    assert res.path.tolist() == [[0, 2, 5], [0, 2, PAD], [0, PAD, PAD]]
    assert res.bonus.tolist() == [7, 2, 4]
    assert res.accepted_tokens.tolist() == [[4, 2, 7], [4, 2, PAD], [4, PAD, PAD]]


def test_max_depth_and_max_width_truncate_the_tree() -> None:
    """Hints smaller than the tree: deeper / later-ranked nodes act as padding."""
    chain_tokens = torch.tensor([[1, 3, 5, 2, 6]])
    chain_logits = logits_wanting([[3, 5, 2, 6, 7]])
    greedy_probs = warp_probs(chain_logits, 0.0)
    q = one_hot(chain_tokens, V).float()
    for res in (
        greedy_accept(chain_tokens, chain_parents(4), chain_logits, max_depth=2),
        sample_accept(chain_tokens, chain_parents(4), greedy_probs, max_depth=2),
        sample_accept(chain_tokens, chain_parents(4), greedy_probs, q, max_depth=2, max_width=1),
    ):
        assert res.path.tolist() == [[0, 1, 2]]
        assert res.accepted_tokens.tolist() == [[3, 5, 2]]
    tree_tokens = torch.tensor([[0, 3, 4]])
    tree_probs = warp_probs(logits_wanting([[4, 0, 0]]), 0.0)  # the root wants its 2nd child
    q = one_hot(tree_tokens, V).float()
    res = sample_accept(tree_tokens, torch.tensor([-1, 0, 0]), tree_probs, q, max_depth=1)
    assert res.accepted_tokens.tolist() == [[4, 0]]  # node 2 taken, its argmax is 0
    res = sample_accept(
        tree_tokens, torch.tensor([-1, 0, 0]), tree_probs, q, max_depth=1, max_width=1
    )
    assert res.path.tolist() == [[0, PAD]] and res.accepted_tokens.tolist() == [[4, PAD]]


def test_greedy_oracle_drafts_accept_everything() -> None:
    """Drafts equal to the target's argmax chain: all K accepted, τ = K + 1."""
    k, batch = 5, 16
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(batch, k + 1, 50, generator=gen)
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), logits[:, :-1].argmax(-1)], 1)
    stats = SpecStats(k)
    for _ in range(4):
        res = greedy_accept(tokens, chain_parents(k), logits, max_depth=k)
        assert res.accept_len.tolist() == [k] * batch
        assert torch.equal(res.accepted_tokens, logits.argmax(-1))
        stats.update(res.accept_len, torch.ones(batch, dtype=torch.bool))
    assert stats.accept_length == k + 1
    assert stats.accept_rate_per_position == [1.0] * k


# ---------------------------------------------------------------------------------------------
# Lossless end to end on a bigram "language model"

VOCAB = 6
START = 0
T = 3  # generated tokens whose joint distribution is tested
ROWS = 20_000


def bigram(seed: int, scale: float) -> Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


P_LOGITS = bigram(10, 1.5)  # target: P[prev] is the next-token distribution
Q_LOGITS = P_LOGITS + bigram(11, 1.2)  # a different, imperfect drafter


def warped(logits: Tensor) -> Tensor:
    return warp_probs(logits, 1.0, 0, 0.8)


P, Q = warped(P_LOGITS), warped(Q_LOGITS)

Draft = tuple[Tensor, Tensor, Tensor | None]  # tokens [B, N], parents [N], draft_probs or None


def draft_chain_sampled(root: Tensor, gen: torch.Generator, k: int = 3) -> Draft:
    tokens, qs = [root], [torch.zeros(root.shape[0], VOCAB)]
    for _ in range(k):
        q = Q[tokens[-1]]
        tokens.append(sample(q, gen))
        qs.append(q)
    return torch.stack(tokens, 1), chain_parents(k), torch.stack(qs, 1)


def draft_chain_sampled_as_deterministic(root: Tensor, gen: torch.Generator) -> Draft:
    """The one-hot rule is lossless for any drafts chosen independently of its coins."""
    tokens, parents, _ = draft_chain_sampled(root, gen)
    return tokens, parents, None


TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 2])  # branching 2, depth 2


def draft_tree_topk(root: Tensor, gen: torch.Generator) -> Draft:
    """EAGLE-style deterministic tree: top-2 of the drafter at each node, depth 2."""
    level1 = Q[root].topk(2, dim=-1).indices  # [B, 2]
    level2 = Q[level1].topk(2, dim=-1).indices.flatten(1)  # [B, 4]: children of 1, then of 2
    return torch.cat([root[:, None], level1, level2], 1), TREE_PARENTS, None


def draft_tree_sampled(root: Tensor, gen: torch.Generator) -> Draft:
    """Two i.i.d. samples from q at each node, depth 2 (siblings may repeat a token)."""
    q1 = Q[root][:, None].expand(-1, 2, -1)
    level1 = sample(q1, gen)
    q2 = Q[level1].repeat_interleave(2, dim=1)
    level2 = sample(q2, gen)
    tokens = torch.cat([root[:, None], level1, level2], 1)
    draft_probs = torch.cat([torch.zeros(root.shape[0], 1, VOCAB), q1, q2], 1)
    return tokens, TREE_PARENTS, draft_probs


Accept = Callable[[Tensor, Tensor, Tensor, Tensor | None, torch.Generator], AcceptResult]


def lossless(tokens, parents, p, q, gen) -> AcceptResult:
    return sample_accept(tokens, parents, p, q, generator=gen)


def chain_result(tokens: Tensor, accept_len: Tensor, bonus: Tensor) -> AcceptResult:
    k = tokens.shape[1] - 1
    col = torch.arange(k + 1)
    drafts = torch.cat([tokens[:, 1:], torch.full_like(bonus[:, None], PAD)], 1)
    emitted = torch.where(col < accept_len[:, None], drafts, PAD)
    emitted = emitted.scatter(1, accept_len[:, None], bonus[:, None])
    path = torch.where(col <= accept_len[:, None], col, PAD)
    return AcceptResult(accept_len, path, bonus, emitted)


def wrong_accept_all(tokens, parents, p, q, gen) -> AcceptResult:
    """Broken rule: trust the drafter blindly."""
    k = tokens.shape[1] - 1
    return chain_result(tokens, torch.full((tokens.shape[0],), k), sample(p[:, -1], gen))


def wrong_forget_residual(tokens, parents, p, q, gen) -> AcceptResult:
    """Broken rule (a classic bug): right acceptance test, bonus from p instead of the
    residual normalize(max(p - q, 0)) after a rejection."""
    batch, n, _ = p.shape
    rows, child = torch.arange(batch)[:, None], torch.arange(1, n)
    coins = torch.rand(batch, n - 1, generator=gen)
    ok = coins * q[rows, child, tokens[:, 1:]] < p[rows, child - 1, tokens[:, 1:]]
    accept_len = ok.long().cumprod(1).sum(1)
    bonus = sample(p[torch.arange(batch), accept_len], gen)
    return chain_result(tokens, accept_len, bonus)


def speculative_first_tokens(
    draft: Callable[[Tensor, torch.Generator], Draft], accept: Accept, seed: int
) -> Tensor:
    """ROWS independent generations from START, T rounds (each emits >= 1 token) -> [ROWS, T]."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((ROWS, 4 * T + 1), PAD)  # last column swallows what lies past a row's emit
    count = torch.zeros(ROWS, dtype=torch.long)
    root = torch.full((ROWS,), START)
    for _ in range(T):
        tokens, parents, draft_probs = draft(root, gen)
        res = accept(tokens, parents, P[tokens], draft_probs, gen)
        col = torch.arange(res.accepted_tokens.shape[1])
        emit = col < res.accept_len[:, None] + 1
        out.scatter_(
            1, torch.where(emit, count[:, None] + col, out.shape[1] - 1), res.accepted_tokens
        )
        count += res.accept_len + 1
        root = res.bonus  # the bonus is the last emitted token: next round's root
    return out[:, :T]


def exact_joint() -> Tensor:
    """P(x1, x2, x3 | START) of the (warped) target, float64, flattened to VOCAB**3."""
    p = P.double()
    return (p[START][:, None, None] * p[:, :, None] * p[None, :, :]).flatten()


def chi_square_critical(df: int, z: float) -> float:
    """Wilson–Hilferty upper quantile of chi2(df) at standard-normal quantile z (no scipy)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def goodness_of_fit(samples: Tensor) -> tuple[bool, float, float]:
    """Chi-square test of the joint of the first T tokens against the exact target joint.

    Outcomes of probability exactly 0 must never occur; cells expected below 5 are pooled.
    z = 4.75 is p ≈ 1e-6: generous against false alarms, yet wrong rules fail by miles.
    """
    index = (samples * torch.tensor([VOCAB**2, VOCAB, 1])).sum(1)
    observed = torch.bincount(index, minlength=VOCAB**T).double()
    expected = exact_joint() * samples.shape[0]
    if observed[expected == 0].sum() > 0:
        return False, math.inf, 0.0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    critical = chi_square_critical(int(keep.sum()) - 1, z=4.75)
    return stat < critical, stat, critical


DRAFTERS = {
    "chain_sampled_q_rule": draft_chain_sampled,
    "chain_sampled_one_hot_rule": draft_chain_sampled_as_deterministic,
    "tree_top2_deterministic": draft_tree_topk,
    "tree_sampled_q_rule": draft_tree_sampled,
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_sample_accept_is_lossless(name: str) -> None:
    samples = speculative_first_tokens(DRAFTERS[name], lossless, seed=123)
    ok, stat, critical = goodness_of_fit(samples)
    assert ok, f"{name}: chi2 {stat:.1f} >= {critical:.1f}: output is not the target distribution"


def test_plain_sampling_passes_the_same_test() -> None:
    """Calibration: drawing straight from the target passes with a typical statistic."""
    gen = torch.Generator().manual_seed(7)
    x = torch.full((ROWS,), START)
    cols = []
    for _ in range(T):
        x = sample(P[x], gen)
        cols.append(x)
    assert goodness_of_fit(torch.stack(cols, 1))[0]


@pytest.mark.parametrize("wrong", [wrong_accept_all, wrong_forget_residual])
def test_losslessness_test_has_power(wrong: Accept) -> None:
    samples = speculative_first_tokens(draft_chain_sampled, wrong, seed=123)
    ok, stat, critical = goodness_of_fit(samples)
    assert not ok, f"{wrong.__name__} went undetected (chi2 {stat:.1f} < {critical:.1f})"


def test_speculative_greedy_equals_plain_greedy() -> None:
    """Greedy with a wrong drafter emits exactly the target's greedy continuation."""
    p_table, q_table = P_LOGITS, Q_LOGITS
    root = torch.arange(VOCAB)  # one row per start token
    plain = [root]
    for _ in range(12):
        plain.append(p_table[plain[-1]].argmax(-1))
    plain_out = torch.stack(plain[1:], 1)
    out, count = torch.full((VOCAB, 12 + 4), PAD), torch.zeros(VOCAB, dtype=torch.long)
    accepted_any = False
    while int(count.min()) < 12:
        tokens = [root]
        for _ in range(3):
            tokens.append(q_table[tokens[-1]].argmax(-1))
        tokens = torch.stack(tokens, 1)
        res = greedy_accept(tokens, chain_parents(3), p_table[tokens], max_depth=3)
        accepted_any |= bool((res.accept_len > 0).any())
        for b in range(VOCAB):
            n = int(res.accept_len[b]) + 1
            c = int(count[b])
            if c < 12:  # out has room for 12 + one round
                out[b, c : c + n] = res.accepted_tokens[b, :n]
        count += res.accept_len + 1
        root = res.bonus
    assert accepted_any
    assert torch.equal(out[:, :12], plain_out)


# ---------------------------------------------------------------------------------------------
# Cross-checks between implementations


def random_tree_batch(seed: int, batch: int = 2000, n: int = 9, vocab: int = 12):
    gen = torch.Generator().manual_seed(seed)
    parents = random_parents(batch, n, gen)
    tokens = torch.argsort(torch.rand(batch, vocab, generator=gen), 1)[:, :n]  # distinct tokens
    # a peaked target so that children are often accepted
    logits = torch.randn(batch, n, vocab, generator=gen) * 2
    logits.scatter_add_(
        2, tokens[:, None, :].expand(-1, n, -1), torch.rand(batch, n, n, generator=gen) * 3
    )
    valid = torch.rand(batch, n, generator=gen) > 0.15
    valid[:, 0] = True
    return tokens, parents, logits, valid


def assert_same_result(a: AcceptResult, b: AcceptResult) -> None:
    for field in ("accept_len", "path", "bonus", "accepted_tokens"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_one_hot_rule_equals_q_rule_with_one_hot_proposals() -> None:
    """The closed-form deterministic rule and the tree walk of the q-rule, fed one-hot q and the
    same coins, must take identical decisions."""
    tokens, parents, logits, valid = random_tree_batch(0)
    probs = warp_probs(logits, 1.0, 0, 0.9)
    q = one_hot(tokens, probs.shape[-1]).float()
    a = sample_accept(tokens, parents, probs, None, valid, torch.Generator().manual_seed(5))
    b = sample_accept(tokens, parents, probs, q, valid, torch.Generator().manual_seed(5))
    assert_same_result(a, b)
    assert int(a.accept_len.max()) >= 2


@pytest.mark.parametrize("with_q", [False, True])
def test_sample_accept_with_greedy_target_equals_greedy_accept(with_q: bool) -> None:
    tokens, parents, logits, valid = random_tree_batch(1)
    probs = warp_probs(logits, 0.0)
    q = torch.softmax(torch.randn_like(logits), -1) if with_q else None
    res = sample_accept(tokens, parents, probs, q, valid, torch.Generator().manual_seed(0))
    assert_same_result(res, greedy_accept(tokens, parents, logits, valid))


@pytest.mark.parametrize("with_q", [False, True])
def test_sample_accept_result_is_consistent(with_q: bool) -> None:
    tokens, parents, logits, valid = random_tree_batch(2)
    probs = warp_probs(logits, 0.8, 5, 0.9)
    q = torch.softmax(torch.randn_like(logits), -1) if with_q else None
    res = sample_accept(tokens, parents, probs, q, valid, torch.Generator().manual_seed(0))
    depth = tree_depth(parents)
    for b in range(0, tokens.shape[0], 50):
        n = int(res.accept_len[b])
        path = res.path[b].tolist()
        assert path[0] == 0 and all(x == PAD for x in path[n + 1 :])
        for d in range(1, n + 1):
            node = path[d]
            assert bool(valid[b, node]) and int(parents[b, node]) == path[d - 1]
            assert int(depth[b, node]) == d
            assert int(res.accepted_tokens[b, d - 1]) == int(tokens[b, node])
        assert int(res.accepted_tokens[b, n]) == int(res.bonus[b])
        assert float(probs[b, path[n], res.bonus[b]]) > 0  # bonus from the target's support
        children = tokens[b][(parents[b] == path[n]) & valid[b]]
        if not with_q:  # one-hot rule: the bonus is never a rejected child's token
            assert int(res.bonus[b]) not in children.tolist()


# ---------------------------------------------------------------------------------------------
# SpecStats


def test_spec_stats_definitions() -> None:
    stats = SpecStats(3)
    on = torch.tensor([True, True, False])
    stats.update(torch.tensor([3, 1, 2]), on)
    stats.update(torch.tensor([0, 2, 3]), torch.tensor([True, True, True]))
    # rounds counted: (3, 1) then (0, 2, 3) -> 5 rounds, accepted 9, emitted 14
    assert stats.histogram == [1, 1, 1, 2]
    d = stats.to_dict(per_request=True)
    assert d["rounds"] == 5 and d["accepted_tokens"] == 9 and d["emitted_tokens"] == 14
    assert d["drafted_tokens"] == 15
    assert stats.accept_length == pytest.approx(14 / 5)
    assert stats.accept_rate_per_position == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert stats.accept_length == pytest.approx(1 + sum(stats.accept_rate_per_position))
    assert d["per_request"][0]["accept_length"] == pytest.approx((4 + 1) / 2)
    assert d["per_request"][2]["rounds"] == 1
    stats.reset_rows([0])
    assert stats.request(0)["rounds"] == 0 and stats.rounds == 5
    tree = SpecStats(2, draft_tokens_per_round=6)
    tree.update(torch.tensor([2, 0]))
    assert tree.to_dict()["accept_rate"] == pytest.approx(2 / 12)
    assert SpecStats(4).accept_length == 0.0
