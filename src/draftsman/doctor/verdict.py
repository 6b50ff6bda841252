"""From measurements to report lines and a verdict: the live and pay checks, and which cause the
evidence points at (pure functions over scores, probes and measurement dicts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftsman.doctor.checks import FAIL, PASS, WARN, Check
from draftsman.doctor.probes import (
    EXACT_TOL,
    EXPECT_WARN,
    Probe,
    clearly_better,
    live_gap,
    matching_probes,
    same_answers,
)
from draftsman.doctor.score import Score
from draftsman.spec.engine import SpecConfig

# Checks whose WARN/FAIL can explain a low expected acceptance that no probe recovers.
CHECKPOINT_CAUSES = ("hidden sizes", "vocab", "d2t", "t2d", "layer ids", "rope", "drafter tensors", "chat template")


# ---- live and pay checks --------------------------------------------------------------------------
def live_check(live: dict, expected: Score | None, name: str) -> Check:
    tau = live["accept_length"]
    rates = " ".join(f"{p:.2f}" for p in live["accept_rate_per_position"])
    ev = {"accept_length": tau, "expected_accept_length": None if expected is None else expected.accept_length,
          "identical": live.get("identical"), "simulated": live.get("simulated")}
    sim = f" [simulating: {live['simulated']}]" if live.get("simulated") else ""
    if live.get("identical") is False:
        return Check(name, FAIL, f"greedy speculative output differs from plain greedy decoding: the engine is not "
                     f"lossless (τ {tau:.2f}){sim}", ev)
    if expected is None:
        return Check(name, PASS, f"{live['source']}: τ {tau:.2f} (p_i {rates}){sim}", ev)
    status = live_gap(tau, expected.accept_length)
    msg = f"{live['source']}: τ {tau:.2f} (p_i {rates}) vs expected {expected.accept_length:.2f}{sim}"
    if status != PASS:
        msg += " -- the integration loses acceptance the drafter has"
    return Check(name, status, msg, ev)


def server_check(server: dict, expected: Score | None, reference: dict | None, spec: SpecConfig) -> Check:
    """The server's τ against draftsman's engine on the same prompts and spec (else the expected)."""
    name = "live acceptance (server)"
    if server["accept_length"] is None:
        return Check(name, WARN, f"{server['url']}: no acceptance data (no spec_decoding field in responses, no "
                     "draftsman:/vllm: spec_decode counters moved on /metrics)", {"notes": server.get("notes")})
    ref = reference["accept_length"] if reference is not None else (None if expected is None else expected.accept_length)
    what = "draftsman's engine" if reference is not None else "expected"
    tau = server["accept_length"]
    ev = {"accept_length": tau, "reference_accept_length": ref, "acceptance_source": server["acceptance_source"],
          "text_matches": server.get("text_matches")}
    msg = f"{server['url']} ({server['model']}): τ {tau:.2f} from {server['acceptance_source']}"
    if ref is None:
        return Check(name, PASS, msg, ev)
    msg += f" vs {ref:.2f} ({what}, same prompts and spec)"
    if server.get("text_matches"):
        msg += f"; {server['text_matches']}"
    depth = len(server.get("accept_rate_per_position") or [])
    if depth and depth != spec.steps:
        msg += (f"; the server drafts {depth} tokens per round, doctor assumed {spec.steps}: pass --spec-steps {depth} "
                "(and the server's --spec-topk) for a like-for-like reference")
    status = live_gap(tau, ref)
    if status != PASS:
        msg += " -- the served integration loses acceptance the drafter has"
    return Check(name, status, msg, ev)


def pay_check(pay: dict) -> Check:
    rows = pay["rows"]
    parts = ", ".join(f"{r['speedup']:.2f}x at bs {r['batch_size']}" for r in rows)
    src = f"τ {pay['accept_length']:.2f} ({pay['accept_length_source']})"
    ev = {"loses_from_batch_size": pay["loses_from_batch_size"], "pays_up_to_batch_size": pay["pays_up_to_batch_size"]}
    if pay["loses_from_batch_size"] is None:
        return Check("will it pay", PASS, f"predicted speed-up {parts} ({src}); pays at every measured batch size", ev)
    fixed = ("draftsman's default (adaptive) policy decodes plainly where speculation loses; a fixed setting "
             "(--spec-* flags, --spec-policy fixed) or an engine without one (SGLang, vLLM) runs at the speed-ups above")
    if pay["pays_up_to_batch_size"] is None:
        return Check("will it pay", WARN, f"predicted speed-up {parts} ({src}): speculation loses at every measured "
                     f"batch size; {fixed}", ev)
    return Check("will it pay", WARN, f"predicted speed-up {parts} ({src}): speculation loses beyond batch size "
                 f"{pay['pays_up_to_batch_size']} (from {pay['loses_from_batch_size']}); {fixed}", ev)


# ---- verdict ------------------------------------------------------------------------------------
def _lines(checks: Sequence[Check]) -> str:
    return "; ".join(f"{c.name}: {c.message}" for c in checks)


def configuration_verdict(expected: Score, probes: Sequence[Probe]) -> dict[str, Any] | None:
    """A probe clearly beats the configuration: the drafter was trained another way."""
    better = sorted((p for p in probes if p.score is not None and clearly_better(p.score, expected)),
                    key=lambda p: -p.score.accept_length)
    if not better:
        return None
    b = better[0]
    msg = (f"configuration problem: this drafter was trained with {b.trained_with}; the configuration uses "
           f"{b.configured} (τ {b.score.accept_length:.2f} vs {expected.accept_length:.2f} as configured)")
    if len(better) > 1:
        msg += "; also scoring clearly higher: " + ", ".join(p.name for p in better[1:])
    return {"kind": "configuration", "causes": [p.name for p in better], "message": msg}


def low_expected_verdict(expected: Score, suspects: Sequence[Check]) -> dict[str, Any] | None:
    """Low under every convention: a static warning that explains it, else training/data."""
    if expected.step0 >= EXPECT_WARN:
        return None
    numbers = f"step-0 {expected.step0:.2f}, τ {expected.accept_length:.2f}"
    if suspects:
        return {"kind": "checkpoint", "causes": [c.name for c in suspects],
                "message": f"checkpoint problem: expected acceptance is low ({numbers}) and no probed convention "
                f"does better; likely cause: {_lines(suspects)}"}
    return {"kind": "training", "causes": ["expected acceptance"],
            "message": f"training/data problem: the drafter predicts the target's own answers poorly ({numbers}) "
            "under every convention probed; train longer or on target-written data (draftsman prepare-data)"}


def integration_verdict(meas: dict, label: str, reference: float, expected: Score,
                        probes: Sequence[Probe]) -> dict[str, Any] | None:
    """Expected fine, live far lower (or somewhat lower, and a probe reproduces it): the probes
    whose expected τ reproduces the live one."""
    if meas.get("accept_length") is None:
        return None
    gap = live_gap(meas["accept_length"], reference)
    if gap == PASS and same_answers(meas) and meas["accept_length"] < reference - EXACT_TOL:
        gap = WARN  # same answers, lower τ: small, but real (a probe must still reproduce it)
    matches = matching_probes(meas, probes, expected) if gap != PASS else []
    if gap == PASS or (gap == WARN and not matches):
        return None
    sim = f" [simulating {meas['simulated']}]" if meas.get("simulated") else ""
    msg = (f"integration problem: the drafter is fine (expected τ {expected.accept_length:.2f}), but the {label}"
           f"{sim} gets τ {meas['accept_length']:.2f}")
    if matches:
        first = matches[0][0]
        msg += f"; likely cause: {first.as_fault} (probe '{first.name}' expects τ {first.score.accept_length:.2f})"
        if len(matches) > 1:
            msg += "; also consistent with: " + ", ".join(f"{p.name} (τ {p.score.accept_length:.2f})"
                                                           for p, _ in matches[1:])
    else:
        msg += ("; no probed convention reproduces it: check the engine's speculation settings, dtype, attention "
                "kernels (e.g. MLA verify) and which drafter and layers it actually loaded")
    return {"kind": "integration", "causes": [p.name for p, _ in matches], "message": msg}


def verdict(checks: Sequence[Check], expected: Score | None, probes: Sequence[Probe], live: dict | None,
            server: dict | None, simulated: bool = False) -> dict[str, Any]:
    """{kind: healthy | configuration | checkpoint | training | integration, message, causes}."""
    suspects = [c for c in checks if c.status in (FAIL, WARN) and c.name in CHECKPOINT_CAUSES]
    if expected is None:
        fails = [c for c in checks if c.status == FAIL] or suspects
        return {"kind": "checkpoint", "causes": [c.name for c in fails],
                "message": f"the drafter cannot be scored: {_lines(fails)}"}
    found = configuration_verdict(expected, probes)
    if found:
        return found
    engine_ref = live["accept_length"] if live is not None and not simulated else expected.accept_length
    if server is not None:
        found = integration_verdict(server, "server", engine_ref, expected, probes)
    if live is not None:
        found = found or integration_verdict(live, "draftsman engine", expected.accept_length, expected, probes)
    low = low_expected_verdict(expected, suspects)
    if found:  # an engine losing acceptance the drafter has comes first; a weak drafter is a caveat
        if low is not None:
            found["message"] += f"; besides, {low['message']}"
        return found
    if low is not None:
        if server is not None and server.get("accept_length") is not None:
            low["message"] += (f"; the integration is healthy: the server gets τ {server['accept_length']:.2f}, "
                               f"as expected ({engine_ref:.2f})")
        return low
    msg = f"healthy: expected step-0 {expected.step0:.2f}, τ {expected.accept_length:.2f}"
    if live is not None:
        msg += f"; draftsman's engine gets τ {live['accept_length']:.2f}"
    if server is not None and server.get("accept_length") is not None:
        msg += f"; the server gets τ {server['accept_length']:.2f}"
    if suspects:
        msg += f"; but: {_lines(suspects)}"
    return {"kind": "healthy", "causes": [c.name for c in suspects], "message": msg}
