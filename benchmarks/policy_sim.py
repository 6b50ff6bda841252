"""A simulation, not a measurement: the adaptive policy (draftsman.spec.adaptive.AdaptivePolicy,
the real class) deciding batch-1 rounds against modelled costs, beside each fixed arm run
throughout on the same draws. It answers what a policy change does to the issue-28 goals where a
device run is too noisy (CPU) or not to be had, before it is measured.

    python benchmarks/policy_sim.py --seeds 16 --set confidence_z=0 --out benchmarks/results/policy_sim_z0.json

Each profile models one measured case: round times of plain decoding and of the three default
arms, each arm's per-draft acceptance probability p (a row accepts k drafts with probability
p^k (1-p), at most `steps`; τ = 1 + sum p^k), a per-request join, the drafter's catch-up before
a speculative round after plain ones (fixed + per pair, outside the policy's clock, as in the
session), and log-normal round-time noise. Requests draw an ease factor (p x U(0.85, 1.1)) so
texts differ. The session's plain holds are modelled (plain_hold / held). Per profile it prints
the adaptive arm's time against the best fixed arm's (vs_best: mean and 10th percentile over
seeds), against plain decoding's, and its share of speculative rounds. --drift moves the
machine's speed under every arm alike (a fixed arm's total moves with it too, so ratios show
what drift costs the policy's choices), --switch-bias slows the first round after a change of
arm. The figures are only as good as the model: joins, captures, batch > 1 and draining are not
in it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Hashable

from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

from draftsman.spec.adaptive import PLAIN, AdaptivePolicy
from draftsman.spec.engine import SpecConfig

TREE, SMALL, CHAIN = SpecConfig(), SpecConfig(steps=5, topk=4, draft_tokens=6), SpecConfig.chain(5)
CPU = {"catch": (5e-3, 0.15e-3), "join": 25e-3, "noise": 0.12}
H200 = {"catch": (0.3e-3, 0.0), "join": 3e-3, "noise": 0.05}
# name -> plain round seconds, {arm: (round seconds, p)}, and the machine's other costs
PROFILES: dict[str, dict] = {
    # reference pair on CPU (results/never_slower_cpu_reference.json, fixed arms' steps / rounds):
    # GSM8K T=0, where the tree ran 1.075x plain decoding ...
    "cpu_gsm8k_t0": {"plain": 10e-3, "arms": {TREE: (30e-3, 0.75), SMALL: (33e-3, 0.70), CHAIN: (29e-3, 0.69)}, **CPU},
    # ... MT-bench T=0, where it ran 0.92x ...
    "cpu_mtbench_t0": {"plain": 10e-3, "arms": {TREE: (30e-3, 0.68), SMALL: (33e-3, 0.64), CHAIN: (29e-3, 0.63)},
                       **CPU},
    # ... and T=1, where every arm loses by half
    "cpu_t1": {"plain": 10e-3, "arms": {TREE: (30e-3, 0.40), SMALL: (33e-3, 0.38), CHAIN: (29e-3, 0.35)}, **CPU},
    # reference pair on the H200, batch 1 (results/never_slower_h200_reference_8c755d3.json: plain
    # 0.92 ms, tree 2.66 ms, 1.19x on GSM8K T=0; the small arms' costs are guesses)
    "h200_gsm8k_t0": {"plain": 0.92e-3, "arms": {TREE: (2.66e-3, 0.79), SMALL: (2.2e-3, 0.72), CHAIN: (2.0e-3, 0.70)},
                      **H200},
    "h200_t1": {"plain": 0.92e-3, "arms": {TREE: (2.66e-3, 0.42), SMALL: (2.2e-3, 0.40), CHAIN: (2.0e-3, 0.38)},
                **H200},
}


def draw_accepted(p: float, steps: int, rng: random.Random) -> int:
    k = 0
    while k < steps and rng.random() < p:
        k += 1
    return k


def machine_speed(seed: int, drift: float, period: int):
    """speed(t) -> the factor a round's time takes at t, in plain rounds' worth of time elapsed:
    1.0 without drift, else a level drawn log-uniformly within ±drift (0.2: 0.83-1.2x) every
    `period` of them, the same for every arm simulated with this seed (a machine's speed moving
    under all of them alike, at the same moments)."""
    rng, levels = random.Random(seed * 7919 + 1), []

    def speed(t: float) -> float:
        if drift == 0:
            return 1.0
        while len(levels) <= t // period:
            levels.append(math.exp(rng.uniform(-math.log1p(drift), math.log1p(drift))))
        return levels[int(t // period)]
    return speed


def simulate(profile: dict, arm: SpecConfig | str | None, seed: int, policy_kw: dict,
             requests: int = 16, warmup: int = 4, tokens: int = 64) -> tuple[float, int, int]:
    """(Seconds of the timed requests, their speculative rounds, their plain rounds) of one arm,
    or of the adaptive policy (arm "adaptive"), over the same seeded draws. The profile's
    "drift" (± fraction, every "drift_period" plain rounds' time: machine_speed) scales every round's time;
    "switch_bias" is how much slower a round runs when its arm differs from the round before's."""
    rng = random.Random(seed)
    speed = machine_speed(seed, profile.get("drift", 0.0), int(profile.get("drift_period", 256)))
    bias, last, elapsed = profile.get("switch_bias", 0.0), None, 0.0
    policy = AdaptivePolicy([TREE, SMALL, CHAIN], **policy_kw) if arm == "adaptive" else None
    total, spec_rounds, plain_rounds = 0.0, 0, 0
    for i in range(warmup + requests):
        timed, ease = i >= warmup, rng.uniform(0.85, 1.1)
        left, since_spec, hold, held = tokens, 0, 0, False
        seconds = profile["join"]
        if policy is not None:
            policy.observe_join(profile["join"])
        while left > 0:
            if policy is None:
                choice: Hashable = arm
            elif hold > 0:
                choice, hold, held = PLAIN, hold - 1, True
            else:
                choice, held = policy.choose(1), False
                hold = policy.plain_hold(1) if choice is PLAIN else 0
            jitter = (math.exp(rng.gauss(0.0, profile["noise"])) * speed((elapsed + seconds) / profile["plain"])
                      * (1.0 + bias * (choice != last)))
            last = choice
            if choice is PLAIN:
                sec, accepted = profile["plain"] * jitter, []
                since_spec += 1
                plain_rounds += timed
            else:
                if since_spec and policy is not None:
                    fixed, per_pair = profile["catch"]
                    seconds += fixed + per_pair * since_spec
                since_spec = 0
                base, p = profile["arms"][choice]
                sec, accepted = base * jitter, [draw_accepted(min(0.97, p * ease), choice.steps, rng)]
                spec_rounds += timed
            seconds += sec
            left -= 1 + sum(accepted)
            if policy is not None:
                if held:
                    policy.held(1, sec)
                else:
                    policy.observe(choice, 1, sec, accepted)
        elapsed += seconds
        if timed:
            total += seconds
    return total, spec_rounds, plain_rounds


def evaluate(profile: dict, seeds: range, policy_kw: dict) -> dict:
    vs_best, vs_plain, spec_share = [], [], []
    for seed in seeds:
        fixed = {a: simulate(profile, a, seed, {})[0] for a in [PLAIN, *profile["arms"]]}
        adaptive, spec, plain = simulate(profile, "adaptive", seed, policy_kw)
        vs_best.append(min(fixed.values()) / adaptive)
        vs_plain.append(fixed[PLAIN] / adaptive)
        spec_share.append(spec / max(1, spec + plain))
    ranked = sorted(vs_best)
    return {"vs_best_mean": sum(vs_best) / len(vs_best), "vs_best_p10": ranked[len(ranked) // 10],
            "vs_plain_mean": sum(vs_plain) / len(vs_plain), "spec_share": sum(spec_share) / len(spec_share)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated, of: " + ", ".join(PROFILES))
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an AdaptivePolicy field for the adaptive arm (repeatable), e.g. confidence_z=0")
    ap.add_argument("--drift", type=float, default=0.0,
                    help="the machine's speed moves within ±this fraction (0.2: 0.83-1.2x), a new level every "
                         "--drift-period plain rounds' worth of time, under every arm alike (CPU hosts moved "
                         "~±20%% in session 28)")
    ap.add_argument("--drift-period", type=int, default=256)
    ap.add_argument("--switch-bias", type=float, default=0.0,
                    help="a round whose arm differs from the round before's runs this much slower (0.09 on the "
                         "H100: the held-round comment in SpecSession._round)")
    ap.add_argument("--out")
    args = ap.parse_args()
    policy_kw = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in AdaptivePolicy.__dataclass_fields__ or not value:
            ap.error(f"--set {item}: expected FIELD=VALUE with FIELD an AdaptivePolicy field")
        policy_kw[name] = float(value)
    names = args.profiles.split(",")
    unknown = [n for n in names if n not in PROFILES]
    if unknown:
        ap.error(f"--profiles: unknown {', '.join(unknown)} (known: {', '.join(PROFILES)})")
    machine = {"drift": args.drift, "drift_period": args.drift_period, "switch_bias": args.switch_bias}
    result = {"simulation": True, "seeds": args.seeds, "policy": policy_kw, "machine": machine,
              "profiles": {n: evaluate(PROFILES[n] | machine, range(args.seeds), policy_kw) for n in names}}
    write_results(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
