"""Test utilities (not fixtures)."""

from __future__ import annotations

import torch

from draftsman.generate import StopRules
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, Request, run_to_completion
from draftsman.spec.adaptive import PLAIN, AdaptivePolicy, bucket
from draftsman.spec.engine import BACKLOG, SpecConfig, SpecSession


@torch.no_grad()
def greedy_cached(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decode with draftsman's cache API: prefill, then one token per step. [1, T] -> [n]."""
    t = prompt.shape[1]
    cache = model.new_cache(prompt.shape[0], t + n)
    logits = model(prompt, cache=cache)
    out = []
    tok = logits[:, -1].argmax(-1, keepdim=True)
    for i in range(n):
        out.append(tok)
        if i + 1 == n:
            break
        pos = torch.full_like(tok, t + i)
        tok = model(tok, cache=cache, positions=pos)[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, 1)[0]


@torch.no_grad()
def hf_greedy(hf_model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    out = hf_model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    return out[0, prompt.shape[1]:]


class Scripted(AdaptivePolicy):
    """A policy that follows a fixed schedule (None = plain round), then repeats its last arm;
    it records what each round accepted."""

    def __init__(self, schedule):
        super().__init__([SpecConfig.chain(4), SpecConfig(steps=4, topk=3, draft_tokens=10)])
        self.schedule = list(schedule)
        self.log: list[tuple] = []

    def choose(self, batch, ready=None, drain=None):
        self.round += 1
        return self.schedule[min(self.round, len(self.schedule)) - 1]

    def observe(self, arm, batch, seconds, accepted, classes=None):
        self.log.append((arm, list(accepted)))


class ScriptedCurrent(Scripted):
    """Scripted, with each choice made the bucket's current arm (plain from the start), as the
    real policy's are: the session then defers the drafter's work while plain is the choice."""

    def __init__(self, schedule):
        super().__init__(schedule)
        self.current = {b: PLAIN for b in (1, 2, 4, 8)}

    def choose(self, batch, ready=None, drain=None):
        arm = super().choose(batch, ready, drain)
        self.current[bucket(batch)] = arm
        return arm


class ScriptedProbing(Scripted):
    """Scripted, each speculative round a probe (AdaptivePolicy.probing): run in step at batch > 1."""

    def choose(self, batch, ready=None, drain=None):
        arm = super().choose(batch, ready, drain)
        self.probing = arm is not None
        return arm


def mean_accepted(log, rounds) -> float:
    return sum(sum(log[i][1]) / len(log[i][1]) for i in rounds) / len(rounds)


def deferred_vs_eager(target, drafter, prompts, device: str, static: bool | None = None,
                      stretch: int = BACKLOG + 10, spills: int = 1) -> None:
    """The same plain stretch of `stretch` rounds (longer than the backlog) then chain rounds, in a
    session that defers the drafter's work (ScriptedCurrent: plain is the choice; it spills
    `spills` times) and in one that does not (Scripted): outputs are plain decoding's, the
    drafter's caches after the first chain round hold the same pairs, and the chains accept alike. Prompts join one by one (a session's first
    prefill is never deferred). Static and graphed sessions run the deferred chunks in passes of
    the backlog's width (SpecSession._prefill_pending)."""
    chain = SpecConfig.chain(4)
    rules = StopRules(max_new_tokens=stretch + 80)
    greedy = SamplingParams(temperature=0.0)
    plain = [r.state.tokens for r in run_to_completion(PlainSession(target, stretch + 200), prompts, rules, greedy)]
    schedule = [PLAIN] * stretch + [chain] * 8 + [PLAIN] * 5 + [chain] * 8
    runs, states = {}, {}
    for policy in (Scripted(schedule), ScriptedCurrent(schedule)):
        session = SpecSession(target, drafter, None, stretch + 200, policy=policy)
        if static is not None:
            session.static = static
        requests = [Request(i, p, rules, greedy) for i, p in enumerate(prompts)]
        for r in requests:
            session.add([r])
        session.waiting = 0
        while session.num_running:
            session.step()
            if policy.round == stretch + 1:  # after the first chain round: the drafter's cache
                n = session.tensors["n"].tolist()
                states[type(policy).__name__] = [{k: v[:, i, :n[i]].float().cpu() for k, v in
                                                  session.caches[1].buffers.items()} for i in range(len(n))]
        assert [r.state.tokens for r in requests] == plain
        runs[type(policy).__name__] = session, policy.log
    (eager, eager_log), (lazy, lazy_log) = runs["Scripted"], runs["ScriptedCurrent"]
    assert (eager.deferred_prefills, eager.spills) == (0, 0)
    assert lazy.deferred_prefills == len(prompts) - 1 and lazy.spills == spills
    for mine, theirs in zip(states["ScriptedCurrent"], states["Scripted"], strict=True):  # same pairs, same slots
        for k in theirs:
            torch.testing.assert_close(mine[k], theirs[k], atol=1e-4, rtol=1e-4)
    first = range(stretch, stretch + 8)
    assert mean_accepted(eager_log, first) > 1.5  # (a drafter missing the deferred pairs accepts ~nothing)
    assert abs(mean_accepted(lazy_log, first) - mean_accepted(eager_log, first)) <= 0.2 * mean_accepted(eager_log, first)
    later = range(stretch + 13, min(len(eager_log), len(lazy_log)))  # (after 5 more plain rounds)
    assert len(later) >= 2 and mean_accepted(lazy_log, later) > 0.6 * mean_accepted(eager_log, later)
