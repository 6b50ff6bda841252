"""The convention probes: plausible wrong ways to feed this drafter, what each would mean, and the
rules that turn scores into a diagnosis (pure functions; doctor.core runs them).

"Clearly higher": a probe beats the configuration when, on step-0 acceptance or on accepted drafts
per round (τ - 1), it is higher by more than CLEAR_ABS absolute AND more than CLEAR_REL times the
configured value. Positions and chat template probes leave step 0 nearly unchanged by
construction, hence the second measure.

"Positions off by one" shifts the drafted tokens (TTT steps >= 1) one position past their context.
Adding 1 to every drafter position would change nothing: RoPE attention depends on position
differences only, so the off-by-one that matters is between the drafted tokens and the cached
context (an engine that places the depth-d draft at n+d instead of n+d-1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsman.config import RopeConfig
from draftsman.doctor.checks import (
    FAIL,
    PASS,
    SKIP,
    Check,
    describe_rope,
    engine_default,
    rope_differences,
    short_source,
    valid_mapping,
)
from draftsman.doctor.score import Convention, Score

CLEAR_ABS = 0.1
CLEAR_REL = 1.5
EXPECT_FAIL = 0.2  # step-0 acceptance below this: the drafter is broken or untrained
EXPECT_WARN = 0.4
LIVE_FAIL = 0.5  # live accepted drafts per round below this fraction of the expected ones
LIVE_WARN = 0.8


@dataclass
class Probe:
    """One alternative convention: how to score it, and how to say what it would mean."""

    name: str
    convention: Convention | None  # None: not applicable (see note)
    trained_with: str  # "this drafter was trained with <trained_with>"
    configured: str  # "the configuration uses <configured>"
    as_fault: str  # what an engine does wrong if its live acceptance matches this probe
    note: str | None = None
    score: Score | None = None
    layer_ids: tuple[int, ...] | None = None


def clearly_better(probe: Score, configured: Score) -> bool:
    def beats(p: float, c: float) -> bool:
        return p - c > CLEAR_ABS and p > CLEAR_REL * c

    return beats(probe.step0, configured.step0) or beats(probe.accept_length - 1, configured.accept_length - 1)


def _ids_text(ids: Sequence[int]) -> str:
    return f"layer ids {list(ids)}"


def layer_probes(configured: Convention, source: str, n_layers: int, captures: dict[str, dict]) -> list[Probe]:
    """Shifted ids, each engine's reading, and the engines' default."""
    ids = configured.layer_ids
    uses = f"{_ids_text(ids)} ({short_source(source)})"
    out = []
    for shift, why in ((-1, "the +1 of the 'output of layer i' convention applied once too often"),
                       (1, "the +1 of the 'output of layer i' convention missing")):
        new = tuple(i + shift for i in ids)
        name = f"layer ids {shift:+d}"
        ok = all(0 <= i <= n_layers for i in new)
        out.append(Probe(name, dataclasses.replace(configured, layer_ids=new) if ok else None,
                         f"{_ids_text(new)} (the configured ids {shift:+d}: {why})", uses,
                         f"the engine captures {_ids_text(new)} instead of {list(ids)}",
                         None if ok else f"{list(new)} is out of range for a {n_layers}-layer target", layer_ids=new))
    by_ids = {p.layer_ids: p for p in out}
    for engine in ("sglang", "vllm"):
        new = tuple(captures[engine]["layers"])
        label = {"sglang": "SGLang", "vllm": "vLLM"}[engine]
        reading = f"the layers {label} captures ({captures[engine]['source']})"
        if new == ids:
            continue
        if new in by_ids:  # the same layers as a shift: say which engine would use them
            by_ids[new].trained_with += f"; {reading}"
            continue
        ok = len(new) == 3 and all(0 <= i <= n_layers for i in new)
        by_ids[new] = Probe(f"{engine} layer ids", dataclasses.replace(configured, layer_ids=new) if ok else None,
                            f"{_ids_text(new)}, {reading}", uses, f"the engine reads the ids as {label} does ({list(new)})",
                            None if ok else f"{label} would capture {list(new)}: not 3 valid states", layer_ids=new)
        out.append(by_ids[new])
    seen = {ids, *by_ids}
    default = engine_default(n_layers)
    if default not in seen and len(set(default)) == 3:
        out.append(Probe("default layer ids", dataclasses.replace(configured, layer_ids=default),
                         f"the engines' default {_ids_text(default)} ([2, L//2, L-3])", uses,
                         f"the engine ignores the ids and captures the default {list(default)}", layer_ids=default))
    return out


def other_probes(configured: Convention, d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int,
                 drafter_rope: RopeConfig, target_rope: RopeConfig, chat: bool, steps: int) -> list[Probe]:
    """Final norm, vocabulary mapping, chat template, positions and RoPE probes."""
    out = [Probe("post-norm last aux", dataclasses.replace(configured, post_norm=True),
                 "the last aux state taken after the target's final norm",
                 "the residual stream before the final norm (input of layer i)",
                 "the engine passes the last aux hidden state after the target's final norm")]
    absolute = d2t is not None and valid_mapping(d2t, vocab_size) and bool(d2t.any())
    out.append(Probe("d2t absolute", dataclasses.replace(configured, draft_token_ids=d2t) if absolute else None,
                     "d2t holding absolute target ids (target_id = d2t[draft_id])",
                     "d2t as offsets (target_id = draft_id + d2t[draft_id])",
                     "the engine reads d2t as absolute target ids",
                     None if absolute else "d2t is not a list of distinct valid target ids"))
    from_t2d = None
    if t2d is not None and t2d.numel() == vocab_size:
        ids = t2d.bool().nonzero().flatten()
        current = set(configured.draft_token_ids.tolist())
        if ids.numel() == configured.draft_token_ids.numel() and set(ids.tolist()) != current:
            from_t2d = ids
    out.append(Probe("vocab from t2d", dataclasses.replace(configured, draft_token_ids=from_t2d)
                     if from_t2d is not None else None,
                     "the vocabulary t2d marks (draft ids in ascending target-id order)", "the checkpoint's d2t",
                     "the engine maps draft ids through a vocabulary other than d2t's",
                     None if from_t2d is not None else "t2d absent or consistent with d2t"))
    out.append(Probe("no chat template", dataclasses.replace(configured, data="raw") if chat else None,
                     "raw prompts (no chat template)", "prompts rendered with the target's chat template",
                     "prompts reach the model without the chat template",
                     None if chat else "the target has no chat template: prompts are scored raw already"))
    out.append(Probe("positions +1", dataclasses.replace(configured, draft_position_offset=1) if steps > 1 else None,
                     "drafted tokens placed one position further than the context (positions off by one)",
                     "draft step k at index t at position t+k (the pair (x_{t+1}, f_t) sits at t)",
                     "the engine places drafted tokens one position off",
                     None if steps > 1 else "a chain of depth 1 drafts no token after the first"))
    differs = bool(rope_differences(drafter_rope, target_rope))
    out.append(Probe("target rope", dataclasses.replace(configured, rope=target_rope) if differs else None,
                     f"the target's RoPE, {describe_rope(target_rope)}",
                     f"the drafter config's {describe_rope(drafter_rope)}",
                     "the engine builds the drafter's RoPE from the target's config",
                     None if differs else "drafter and target RoPE agree"))
    return out


DEFAULT_ROPE_THETA = 10000.0  # what Llama configs (and engines' readers) fall back to without rope_theta


def integration_probes(configured: Convention, d2t: torch.Tensor | None, drafter_rope: RopeConfig,
                       norm_before_residual: bool) -> list[Probe]:
    """Faults an engine (or a hand-edited export) can introduce while loading a healthy checkpoint:
    the vocabulary map dropped or scrambled, RoPE at the default theta, the residual taken on the
    wrong side of hidden_norm, an extra RMSNorm over cat(aux) before fc. Each reproduces the live
    acceptance such an engine would get."""
    trained_map = "the checkpoint's d2t (target_id = draft_id + d2t[draft_id])"
    reduced = d2t is not None and bool(d2t.any())
    n = configured.draft_token_ids.numel()
    out = [Probe("d2t missing", dataclasses.replace(configured, draft_token_ids=torch.arange(n)) if reduced else None,
                 "draft id i read as target id i (no d2t: zero offsets)", trained_map,
                 "the engine runs without the checkpoint's d2t (draft ids used as target ids)",
                 None if reduced else "d2t absent or all zero: the identity map is the configuration")]
    shuffled = None
    if d2t is not None:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        shuffled = configured.draft_token_ids[perm]
    out.append(Probe("d2t shuffled", dataclasses.replace(configured, draft_token_ids=shuffled)
                     if shuffled is not None else None,
                     "the same target ids assigned to other draft rows (a scrambled d2t)", trained_map,
                     "the engine maps draft rows to the wrong target ids (d2t reordered or of another drafter)",
                     None if shuffled is not None else "no d2t"))
    default_theta = drafter_rope.type == "default" and drafter_rope.theta != DEFAULT_ROPE_THETA
    out.append(Probe("default rope theta",
                     dataclasses.replace(configured, rope=dataclasses.replace(drafter_rope, theta=DEFAULT_ROPE_THETA))
                     if default_theta else None,
                     f"RoPE theta {DEFAULT_ROPE_THETA:g} (the Llama default)", f"the drafter config's {describe_rope(drafter_rope)}",
                     f"the engine builds the drafter's RoPE with theta {DEFAULT_ROPE_THETA:g} (rope_theta not read or wrong)",
                     None if default_theta else f"the drafter's RoPE is not a default RoPE with theta != {DEFAULT_ROPE_THETA:g}"))
    side = "hidden_norm(h)" if norm_before_residual else "h before hidden_norm"
    other = "h before hidden_norm" if norm_before_residual else "hidden_norm(h)"
    out.append(Probe("norm_before_residual flipped", dataclasses.replace(configured, flip_norm_before_residual=True),
                     f"the residual taken from {other} (norm_before_residual {not norm_before_residual})",
                     f"the residual taken from {side} (norm_before_residual {norm_before_residual})",
                     f"the engine reads norm_before_residual as {not norm_before_residual}"))
    out.append(Probe("norm before fc", dataclasses.replace(configured, norm_before_fc=True),
                     "an RMSNorm over cat(aux states) before fc (norm_before_fc true)",
                     "fc over the raw aux states (norm_before_fc false)",
                     "the engine applies an RMSNorm to cat(aux states) before fc (norm_before_fc read as true)"))
    return out


def probe_check(probe: Probe, configured: Score) -> Check:
    name = f"convention probe: {probe.name}"
    if probe.score is None:
        return Check(name, SKIP, f"not applicable: {probe.note}", {})
    s = probe.score
    ev = {"accept_length": s.accept_length, "step0_accept": s.step0, "configured_accept_length": configured.accept_length,
          "configured_step0_accept": configured.step0}
    numbers = f"τ {s.accept_length:.2f} vs {configured.accept_length:.2f} configured, step-0 {s.step0:.2f} vs {configured.step0:.2f}"
    if clearly_better(s, configured):
        return Check(name, FAIL, f"this drafter was trained with {probe.trained_with}; the configuration uses "
                     f"{probe.configured} ({numbers})", ev)
    return Check(name, PASS, f"the configuration scores at least as well ({numbers})", ev)


def probe_json(probe: Probe, configured: Score | None) -> dict:
    s = probe.score
    better = s is not None and configured is not None and clearly_better(s, configured)
    return {"name": probe.name, "applicable": s is not None, "accept_length": None if s is None else s.accept_length,
            "step0_accept": None if s is None else s.step0,
            "delta": None if s is None or configured is None else round(s.accept_length - configured.accept_length, 6),
            "step_accept": None if s is None else s.step_accept,
            "accept_rate_per_position": None if s is None else s.accept_rate_per_position,
            "clearly_better": better, "trained_with": probe.trained_with, "configured": probe.configured,
            "layer_ids": list(probe.layer_ids) if probe.layer_ids else None, "note": probe.note}


# ---- expected and live ---------------------------------------------------------------------------
def expected_check(s: Score, steps: int) -> Check:
    rates = " ".join(f"{p:.2f}" for p in s.accept_rate_per_position)
    msg = (f"τ {s.accept_length:.2f} for a chain of {steps} (p_i {rates}); step-0 acceptance {s.step0:.2f} over "
           f"{s.positions} answer tokens")
    if s.tree is not None:
        msg += f"; a top-{s.tree['topk']} tree at most τ {s.tree['accept_length']:.2f}"
    ev = {"accept_length": s.accept_length, "step0_accept": s.step0}
    if s.step0 < EXPECT_FAIL:
        return Check("expected acceptance", FAIL, msg + f": below {EXPECT_FAIL}, the drafter does not predict the "
                     "target's own answers as configured", ev)
    if s.step0 < EXPECT_WARN:
        return Check("expected acceptance", "WARN", msg + f": below {EXPECT_WARN}, a weak drafter", ev)
    return Check("expected acceptance", PASS, msg, ev)


def live_gap(live_tau: float, expected_tau: float) -> str:
    """PASS / WARN / FAIL: live accepted drafts per round as a fraction of the expected ones."""
    want = expected_tau - 1
    if want < EXPECT_FAIL:  # nothing much to lose
        return PASS
    got = live_tau - 1
    return FAIL if got < LIVE_FAIL * want else "WARN" if got < LIVE_WARN * want else PASS


EXACT_TOL = 0.005  # τ of an engine writing the very answers the replay scored: equal to the token
# (vLLM and draftsman gave the same accepted count at every position on 3 sets; one accepted draft
# in 200 rounds moves τ by 0.005)


def same_answers(live: dict) -> bool:
    """The server wrote exactly the target's greedy answers the replay scored (every text equal):
    its τ must then equal the replay's up to float rounding, and any gap is the integration's."""
    total = live.get("texts_total")
    return bool(total) and live.get("text_equal_chat") == total


def matching_probes(live: dict, probes: Sequence[Probe], expected: Score) -> list[tuple[Probe, float]]:
    """Probes whose expected acceptance reproduces a low live measurement, closest first: distance
    = |Δτ| + mean |Δp_i| over the positions both have. When the server wrote the replay's very
    answers (`same_answers`) the replay predicts its τ exactly, and the tolerance is EXACT_TOL."""
    tau = live["accept_length"]
    rates = live.get("accept_rate_per_position") or []
    tol = EXACT_TOL if same_answers(live) else max(0.1, 0.25 * (tau - 1))
    out = []
    for p in probes:
        s = p.score
        if s is None or s.accept_length >= expected.accept_length - tol:
            continue  # not applicable, or no drop: cannot explain one
        d_tau = abs(s.accept_length - tau)
        n = min(len(rates), len(s.accept_rate_per_position))
        d_pos = sum(abs(a - b) for a, b in zip(rates[:n], s.accept_rate_per_position[:n], strict=True)) / max(1, n)
        if d_tau <= tol:
            out.append((p, d_tau + d_pos))
    return sorted(out, key=lambda x: x[1])
