"""Speculative decoding is lossless: greedy output equals plain greedy output token for token,
sampled output follows the target's distribution, and acceptance is counted right."""

from __future__ import annotations

import math

import pytest
import torch

import draftsman
from draftsman.generate import StopRules, generate_plain
from draftsman.models.eagle3 import init_drafter
from draftsman.sampling import SamplingParams
from draftsman.spec.engine import SpecConfig, SpecEngine

SPECS = {
    "chain4": SpecConfig.chain(4),
    "tree": SpecConfig(steps=3, topk=3, draft_tokens=8),
    "wide": SpecConfig(steps=2, topk=4, draft_tokens=21),
    "default": None,  # SpecEngine's default: adaptive over DEFAULT_CANDIDATES and plain rounds
}


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def target(request):
    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    return draftsman.load_target(path)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("lengths", [[7], [5, 12, 3, 9]])
def test_greedy_speculation_is_lossless(target, spec_name, lengths):
    prompts = prompts_of(lengths)
    rules = StopRules(max_new_tokens=24, eos_ids=frozenset(target.config.eos_token_ids))
    plain = generate_plain(target, prompts, rules)
    drafter = init_drafter(target, seed=1)
    spec = SpecEngine(target, drafter, SPECS[spec_name]).generate(prompts, rules)
    assert spec.token_ids == plain.token_ids
    assert spec.finish_reasons == plain.finish_reasons
    assert spec.stats["rounds"] == spec.stats["spec_rounds"] > 0
    for r, tokens in zip(spec.stats["per_request"], spec.token_ids, strict=True):
        rounds = 1 + r["spec_rounds"] + r["plain_rounds"]  # (each round keeps a token; the last may be cut)
        assert rounds <= len(tokens) <= rounds + r["accepted_tokens"]


class FakeDrafter(torch.nn.Module):
    """The drafter interface the engine uses, with proposals chosen by a rule (no weights)."""

    def __init__(self, target) -> None:
        super().__init__()
        self.vocab = target.config.vocab_size
        self.aux_layer_ids = target.config.default_aux_layer_ids()

    def project(self, aux):
        x = torch.cat(aux, -1) if isinstance(aux, list) else aux
        return x[..., :8]

    def new_cache(self, batch_size, max_len, dtype=None):  # unused by these rules
        from draftsman.kvcache import StaticCache

        return StaticCache.allocate({"k": (1,)}, 1, batch_size, max_len, "cpu", torch.float32)

    def draft_to_target(self, ids):
        return ids


class OracleDrafter(FakeDrafter):
    """Proposes the target's own greedy continuation: the pair at position i predicts
    sequence[i + 2] (the pair holds token i+1 and the target feature of token i)."""

    def __init__(self, target, sequence: list[int]) -> None:
        super().__init__(target)
        self.seq = torch.tensor(sequence)

    def forward(self, input_ids, hidden, positions, cache=None, cache_index=None, attn_mask=None):
        nxt = self.seq[(positions + 2).clamp(max=len(self.seq) - 1)]
        return torch.nn.functional.one_hot(nxt, self.vocab).float() * 20, hidden


class BigramDrafter(FakeDrafter):
    """Proposes what the target predicts after the input token alone: a decent, imperfect guess."""

    def __init__(self, target) -> None:
        super().__init__(target)
        with torch.no_grad():
            self.table = target(torch.arange(self.vocab)[:, None])[:, -1]

    def forward(self, input_ids, hidden, positions, cache=None, cache_index=None, attn_mask=None):
        return self.table[input_ids], hidden


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_oracle_drafter_gives_full_acceptance(target, steps):
    prompt = prompts_of([6])[0]
    n_new = 20
    rules = StopRules(max_new_tokens=n_new)  # no EOS: every round runs to full depth
    long = generate_plain(target, [prompt], StopRules(max_new_tokens=n_new + steps + 2)).token_ids[0]
    engine = SpecEngine(target, OracleDrafter(target, prompt + long), SpecConfig.chain(steps))
    out = engine.generate([prompt], rules)
    assert out.token_ids[0] == long[:n_new]
    assert out.stats["accept_length"] == steps + 1
    assert out.stats["accept_rate_per_position"] == [1.0] * steps


def _chi2_critical(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z=4.75: p ~ 1e-6)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("spec", [SpecConfig.chain(3), SpecConfig(steps=2, topk=3, draft_tokens=7)])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampling_matches_target_distribution(tmp_path_factory, spec, top_p):
    """Tiny vocabulary (8): the joint law of the first two sampled tokens over 4000 runs equals
    the target's own (computed exactly), by a chi-square test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)  # a peaked but not degenerate distribution
    path = tmp_path_factory.mktemp("vocab8")
    hf.save_pretrained(path)
    target = draftsman.load_target(path)
    prompt, n = [1, 5, 3], 4000
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    from draftsman.sampling import warp_probs

    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt]))[0, -1], 1.0, 0, top_p)
        seconds = torch.tensor([[*prompt, t] for t in range(8)])
        p2 = warp_probs(target(seconds)[:, -1], 1.0, 0, top_p)
    expected = (p1[:, None] * p2).flatten() * n
    out = SpecEngine(target, BigramDrafter(target), spec).generate([prompt] * n, StopRules(max_new_tokens=2), params)
    pairs = torch.tensor([t[:2] for t in out.token_ids])
    observed = torch.bincount(pairs[:, 0] * 8 + pairs[:, 1], minlength=64).double()
    keep = expected > 5  # pool sparse bins, as the chi-square approximation needs
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    rest_o, rest_e = observed[~keep].sum(), expected[~keep].sum()
    assert rest_o <= rest_e + 5 * math.sqrt(rest_e + 1) + 5
    assert stat < _chi2_critical(int(keep.sum()) - 1), (stat, int(keep.sum()))
    assert out.stats["accept_length"] > 1.3  # acceptance paths were exercised, not just bonuses


class WrongDrafter(FakeDrafter):
    """Proposes a token the target never picks (its least likely after the input token): every
    draft is rejected, so speculation only costs."""

    def __init__(self, target) -> None:
        super().__init__(target)
        with torch.no_grad():
            self.table = -target(torch.arange(self.vocab)[:, None])[:, -1]

    def forward(self, input_ids, hidden, positions, cache=None, cache_index=None, attn_mask=None):
        return self.table[input_ids], hidden


def test_default_engine_falls_back_to_plain_rounds_where_speculation_loses(target):
    """With a drafter whose drafts are all rejected a speculative round yields one token for the
    cost of drafting and verifying a tree: the default (adaptive) engine measures that and decodes
    the rest plainly, its output still the target's own; a fixed engine never does."""
    prompts = prompts_of([7, 5])
    rules = StopRules(max_new_tokens=80)
    plain = generate_plain(target, prompts, rules)
    engine = SpecEngine(target, WrongDrafter(target))
    out = engine.generate(prompts, rules)
    assert out.token_ids == plain.token_ids
    assert out.stats["accepted_tokens"] == 0
    assert out.stats["plain_rounds"] > 3 * out.stats["spec_rounds"], out.stats
    fixed = SpecEngine(target, WrongDrafter(target), SpecConfig()).generate(prompts, rules)
    assert fixed.token_ids == plain.token_ids
    assert fixed.stats["plain_rounds"] == 0 and fixed.stats["spec_rounds"] > 0
