"""warp_probs must equal transformers' warpers + softmax; sample must follow the distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from draftsman.sampling import SamplingParams, batch_params, make_generator, sample, warp_probs

VOCAB = 50


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' `generate` samples from: warpers in its order, then softmax."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    warpers = [TemperatureLogitsWarper(float(temperature))]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = logits.float()
    for warper in warpers:
        scores = warper(ids, scores)
    return scores.softmax(-1)


def assert_same_probs(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(ours > 0, ref > 0), "different support"
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)


CASES = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.8),
    (0.6, 10, 0.9),
    (1.3, 3, 0.5),
    (1.0, 1, 1.0),
    (2.0, 0, 0.0),  # top_p 0 keeps only the top token
    (0.5, 100, 0.95),  # top_k above the vocab is clamped
    (0.0, 5, 0.5),  # greedy ignores the filters
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_scalar_params_match_transformers(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    ours = warp_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32
    assert_same_probs(ours, hf_probs(logits, temperature, top_k, top_p))


def test_per_row_params_match_transformers() -> None:
    """A batch mixing requests: row i uses CASES[i % len(CASES)], logits [B, N, V] too."""
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(t, p, k) for t, k, p in CASES] * 3
    temperature, top_k, top_p = batch_params(params)
    logits = torch.randn(len(params), 4, VOCAB, generator=g) * 3
    ours = warp_probs(logits, temperature, top_k, top_p)
    for i, sp in enumerate(params):
        ref = hf_probs(logits[i], sp.temperature, sp.top_k, sp.top_p)
        assert_same_probs(ours[i], ref)


def test_top_k_keeps_ties_like_transformers() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 3.0, 3.0, 0.0]])
    ours = warp_probs(logits, 1.0, 2, 1.0)
    assert (ours > 0).tolist() == [[False, False, True, True, True, False]]
    assert_same_probs(ours, hf_probs(logits, 1.0, 2, 1.0))


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    assert (warp_probs(logits, 1.0, 0, 0.8) > 0).tolist() == [[True, True, False, False]]
    assert (warp_probs(logits, 1.0, 0, 0.81) > 0).tolist() == [[True, True, True, False]]
    assert (warp_probs(logits, 1.0, 0, 0.4) > 0).tolist() == [[True, False, False, False]]


def test_greedy_rows_are_one_hot() -> None:
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    probs = warp_probs(logits, torch.tensor([0.0, 1.0, 0.0]), 0, 1.0)
    assert torch.equal(probs[[0, 2]].argmax(-1), logits[[0, 2]].argmax(-1))
    assert torch.equal(probs[[0, 2]].sum(-1), torch.ones(2))
    assert int((probs[[0, 2]] > 0).sum()) == 2
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


def test_invalid_params_raise() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        warp_probs(torch.zeros(1, 3), 1.0, -1, 1.0)


def test_sample_follows_distribution_and_is_reproducible() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    rows = probs.expand(200_000, 4)
    ids = sample(rows, make_generator(0))
    freq = torch.bincount(ids, minlength=4).float() / ids.numel()
    assert freq[1] == 0, "a zero-probability token was drawn"
    torch.testing.assert_close(freq, probs, atol=5e-3, rtol=0)
    assert torch.equal(ids, sample(rows, make_generator(0)))
    # unnormalised input and extra leading dims
    ids3 = sample(torch.tensor([[[0.0, 5.0, 0.0]]]).expand(2, 3, 3))
    assert ids3.shape == (2, 3) and bool((ids3 == 1).all())


@pytest.mark.parametrize("vocab", [1000, 128256, 50000, 16385])
def test_greedy_argmax_is_torch_argmax_with_ties_and_infinities(vocab):
    from draftsman.sampling import greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (6, vocab), generator=g).float()  # many ties: the first index must win
    x[1] = float("-inf")
    x[2, vocab // 2 :] = float("inf")
    x[3, -1] = 9.0  # the maximum in the last (padded) block
    x[4, 7] = float("nan")
    x[5, [5, vocab - 3]] = float("nan")
    torch.testing.assert_close(greedy_argmax(x), x.argmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(greedy_argmax(x.bfloat16()[:, None]), x.bfloat16()[:, None].argmax(-1), rtol=0, atol=0)


def test_cpu_inverse_cdf_draws_across_blocks_and_never_zero_mass() -> None:
    # 600 tokens = 2 full blocks of 256 and a padded third; mass at block edges, zero-mass gaps
    # and a zero-mass final block region: frequencies follow p, no zero-mass token is drawn.
    probs = torch.zeros(600)
    for i, p in {0: 0.05, 255: 0.2, 256: 0.15, 300: 0.1, 511: 0.25, 512: 0.05, 590: 0.2}.items():
        probs[i] = p
    ids = sample(probs.expand(400_000, 600), make_generator(1))
    freq = torch.bincount(ids, minlength=600).float() / ids.numel()
    assert float(freq[probs == 0].sum()) == 0, "a zero-probability token was drawn"
    torch.testing.assert_close(freq, probs, atol=3e-3, rtol=0)


def test_session_skips_filters_only_when_no_row_uses_them() -> None:
    from draftsman.session import DecodeSession

    logits = torch.randn(3, 700) * 3
    rows = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(0.0)]
    t, k, p = batch_params(rows)
    sampling = {"temperature": t, "top_k": k, "top_p": p}
    assert DecodeSession.filters_of(rows) == (False, False)
    # the skipped sort is exact: the same probabilities as warp_probs over the per-row tensors
    assert torch.equal(DecodeSession._warp(logits, sampling, (False, False)), warp_probs(logits, t, k, p))
    rows[1] = SamplingParams(0.7, top_k=5, top_p=0.9)
    t, k, p = batch_params(rows)
    sampling = {"temperature": t, "top_k": k, "top_p": p}
    assert DecodeSession.filters_of(rows) == (True, True)
    warped = DecodeSession._warp(logits, sampling, (True, True))
    assert torch.equal(warped, warp_probs(logits, t, k, p)) and int((warped[1] > 0).sum()) <= 5
