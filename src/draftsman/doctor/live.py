"""Live acceptance and step costs: draftsman's engine on the same prompts, an external server
through the bench client, and the timings that decide whether speculation pays.

`simulate` makes the in-process engine reproduce an integration fault (for testing doctor and for
seeing what a broken integration looks like): "post-norm last aux" hands the drafter the last aux
state after the target's final norm, "layer ids -1" / "layer ids +1" capture shifted layers, and
"no chat template" sends the prompts raw.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from draftsman.generate import StopRules
from draftsman.sampling import SamplingParams
from draftsman.session import PlainSession, Request
from draftsman.spec.engine import SpecConfig, SpecEngine, SpecSession

SIMULATIONS = ("post-norm last aux", "layer ids -1", "layer ids +1", "no chat template")


class PostNormTarget:
    """A target whose last captured aux state comes out of the final norm: what an engine does when
    it hands the drafter `hidden_states` after `model.norm` (everything else is the real target)."""

    def __init__(self, target) -> None:
        self._target = target

    def __getattr__(self, name: str):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def run(self, *args, **kwargs):
        out = self._target.run(*args, **kwargs)
        if out.aux_hidden:
            out.aux_hidden[-1] = self._target.norm(out.aux_hidden[-1])
        return out


@contextmanager
def simulated(target, drafter, simulate: str | None) -> Iterator[tuple[Any, Any]]:
    """(target, drafter) as the simulated integration sees them; the drafter is restored after."""
    if simulate is None or simulate == "no chat template":
        yield target, drafter
        return
    if simulate == "post-norm last aux":
        yield PostNormTarget(target), drafter
        return
    if simulate not in SIMULATIONS:
        raise ValueError(f"cannot simulate {simulate!r}; choose one of {list(SIMULATIONS)}")
    shift = -1 if simulate == "layer ids -1" else 1
    saved = drafter.aux_layer_ids
    drafter.aux_layer_ids = tuple(i + shift for i in saved)
    try:
        yield target, drafter
    finally:
        drafter.aux_layer_ids = saved


def live_in_process(target, drafter, spec: SpecConfig, prompts: Sequence[Sequence[int]], rules: StopRules,
                    reference: Sequence[Sequence[int]] | None, simulate: str | None = None) -> dict[str, Any]:
    """τ and p_i of draftsman's engine (greedy) on the prompts, all at once; `identical` compares
    the output with the target's plain greedy answers (it must hold: speculation is lossless)."""
    with simulated(target, drafter, simulate) as (t, d):
        out = SpecEngine(t, d, spec).generate(prompts, rules, SamplingParams(temperature=0.0))
    s = out.stats
    return {"source": "draftsman engine", "accept_length": s["accept_length"],
            "accept_rate_per_position": s["accept_rate_per_position"], "rounds": s["rounds"],
            "accept_length_histogram": s["accept_length_histogram"],
            "identical": None if reference is None else [list(x) for x in out.token_ids] == [list(x) for x in reference],
            "simulated": simulate, "spec": {"steps": spec.steps, "topk": spec.topk, "draft_tokens": spec.draft_tokens}}


def live_server(url: str, model: str | None, api_key: str | None, prompts: Sequence[str], max_new_tokens: int,
                concurrency: int, chat: bool = True) -> tuple[dict[str, Any], list[str]]:
    """τ and p_i of an OpenAI-compatible server at temperature 0, from its responses'
    `spec_decoding` fields or the deltas of its draftsman:/vllm: spec_decode counters. Returns
    (the measurement with each response's text, notes)."""
    from draftsman import bench_client as bc

    base = bc.base_url(url)
    name = model or bc.served_model(base, api_key)
    cfg = bc.ClientConfig(base, name, chat=chat, max_tokens=max_new_tokens, temperature=0.0, api_key=api_key)
    notes: list[str] = []
    before = bc.fetch_metrics(base, api_key)
    traces, duration = asyncio.run(bc.run_concurrent(cfg, prompts, concurrency))
    after = bc.fetch_metrics(base, api_key)
    acc = bc.acceptance_for(traces, before, after, "served", notes)
    tokens = sum(t.num_tokens for t in traces)
    return {"source": "server", "url": base, "model": name, "accept_length": acc["accept_length"],
            "accept_rate_per_position": acc["accept_rate_per_position"], "rounds": acc["rounds"],
            "acceptance_source": acc["acceptance_source"], "output_tokens": tokens,
            "tokens_per_s": tokens / duration if duration > 0 else None,
            "texts": [t.output for t in traces]}, notes


# ---- step costs -----------------------------------------------------------------------------------
def _timed_steps(session, requests: Sequence[Request], steps: int, warmup: int) -> list[float]:
    session.add(list(requests))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        session.step()  # reads its tokens back to the host: the time covers the device work
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def step_costs(target, drafter, spec: SpecConfig, prompts: Sequence[Sequence[int]], batch_size: int,
               steps: int = 8, warmup: int = 2) -> dict[str, float]:
    """Median seconds of one plain decode step and one speculative round (draft + verify + drafter
    extend) with `batch_size` rows running. Rows never finish inside the window (no EOS, a budget
    larger than the tokens a round can emit), so the batch stays full."""
    rows = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    budget = (warmup + steps + 1) * (spec.steps + 1) + 1
    rules = StopRules(budget)
    max_len = max(len(r) for r in rows) + budget
    greedy = SamplingParams(temperature=0.0)

    def requests() -> list[Request]:
        return [Request(i, r, rules, greedy) for i, r in enumerate(rows)]

    with torch.no_grad():
        plain = _timed_steps(PlainSession(target, max_len), requests(), steps, warmup)
        spec_t = _timed_steps(SpecSession(target, drafter, spec, max_len), requests(), steps, warmup)
    return {"plain_step_s": statistics.median(plain), "spec_round_s": statistics.median(spec_t)}


def pay_table(costs: dict[int, dict[str, float]], accept_length: float) -> dict[str, Any]:
    """Predicted speed-up per batch size: τ × t_plain / t_round (tokens per second of speculation
    over plain decoding), and where it stops paying."""
    rows = []
    for bs in sorted(costs):
        c = costs[bs]
        speedup = accept_length * c["plain_step_s"] / c["spec_round_s"]
        rows.append({"batch_size": bs, "plain_step_ms": round(c["plain_step_s"] * 1e3, 4),
                     "spec_round_ms": round(c["spec_round_s"] * 1e3, 4),
                     "breakeven_accept_length": round(c["spec_round_s"] / c["plain_step_s"], 4),
                     "speedup": round(speedup, 4)})
    losing = [r["batch_size"] for r in rows if r["speedup"] < 1.0]
    paying = [r["batch_size"] for r in rows if r["batch_size"] < (losing[0] if losing else float("inf"))]
    return {"accept_length": accept_length, "rows": rows, "loses_from_batch_size": losing[0] if losing else None,
            "pays_up_to_batch_size": paying[-1] if paying else None}
