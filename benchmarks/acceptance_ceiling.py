"""How much can any drafter be accepted when sampling? A ceiling from the target alone.

A drafted child c of a node is accepted, by the lossless rule draftsman verifies sampled trees
with (recursive rejection over siblings, one-hot proposals: spec/verify.py), with probability
p(c) once its earlier siblings were rejected, so the first position accepts one of k drafted
children with probability sum_c p(c) <= the target's top-k mass at that position. This script
samples the target's own answers (plain decoding at the temperature) and reads, at every
generated position, the warped target distribution's top-1 and top-k mass: the mean is the
ceiling on p_1 (the acceptance rate at the first draft position) for a top-k tree, and top-1
for a chain. A measured p_1 near it means the target's entropy, not the drafter or the
verification, limits acceptance at that temperature.

With --drafter it also decodes the same prompts speculatively (a chain of 5 and the default
tree 5/4/16, fixed, the prompts of a set in one batch) and records τ and p_1 ... p_5 beside the
ceiling; temperature 0 is then useful too (its ceiling is 1).

    python benchmarks/acceptance_ceiling.py --temperatures 0,0.7,1 --drafter REF \
        --out benchmarks/results/acceptance_ceiling_reference.json        (REF: the embedded drafter)
    python benchmarks/acceptance_ceiling.py --target SMOLLM2_DIR --drafter DRAFTER_DIR --temperatures 0,0.7,1 \
        --out benchmarks/results/acceptance_ceiling_smollm2.json

Prints one JSON line: {"target", "drafter", "topk", "runs": [{"dataset", "temperature",
"positions", "top1_mass", "topk_mass", "entropy_nats", "arms": {arm: {"accept_length",
"accept_rate_per_position"}}}]}.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def ceiling(target, prompts: list[list[int]], temperature: float, top_p: float, topk: int, max_new: int,
            eos: frozenset[int], seed: int) -> dict:
    """Mean top-1 / top-k mass and entropy of the warped target distribution along its own
    sampled answers (one forward over prompt + answer per prompt: the logits each decode step saw)."""
    from draftsman.generate import StopRules, generate_plain
    from draftsman.sampling import SamplingParams, warp_probs

    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    out = generate_plain(target, prompts, StopRules(max_new, eos), params)
    if temperature == 0:  # one-hot: the top token is the only one, its mass 1
        return {"positions": out.num_new_tokens, "top1_mass": 1.0, "topk_mass": 1.0, "entropy_nats": 0.0}
    top1 = topk_mass = entropy = 0.0
    n = 0
    for prompt, answer in zip(prompts, out.token_ids, strict=True):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = target(ids)[0, len(prompt) - 1 : len(prompt) + len(answer) - 1].float()
        p = warp_probs(logits, temperature, 0, top_p)
        ranked = p.sort(-1, descending=True).values
        top1 += ranked[:, 0].sum().item()
        topk_mass += ranked[:, :topk].sum().item()
        entropy += -(p * p.clamp_min(1e-30).log()).sum().item()
        n += len(answer)
    return {"positions": n, "top1_mass": top1 / n, "topk_mass": topk_mass / n, "entropy_nats": entropy / n}


def drafter_acceptance(target, drafter, prompts: list[list[int]], temperature: float, top_p: float, max_new: int,
                       eos: frozenset[int], seed: int) -> dict:
    """τ and p_1 ... p_5 of a chain of 5 and the default tree over the prompts, decoded together."""
    from draftsman.generate import StopRules
    from draftsman.sampling import SamplingParams
    from draftsman.spec.engine import SpecConfig, SpecEngine

    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    arms = {}
    for name, spec in (("spec-s5-k1-n6", SpecConfig.chain(5)), ("spec-s5-k4-n16", SpecConfig())):
        stats = SpecEngine(target, drafter, spec).generate(prompts, StopRules(max_new, eos), params).stats
        arms[name] = {"accept_length": stats["accept_length"],
                      "accept_rate_per_position": stats["accept_rate_per_position"]}
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="default: the embedded reference target")
    ap.add_argument("--drafter", help="also measure this drafter's acceptance on the same prompts ('reference': "
                    "the embedded one)")
    ap.add_argument("--datasets", default="mt-bench,humaneval,gsm8k")
    ap.add_argument("--temperatures", default="0.7,1")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--topk", type=int, default=4, help="children per node of the tree (--spec-topk; default 4)")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()

    from h200_json import write_results  # benchmarks/ is on sys.path when run as a script

    from draftsman import reference_pair
    from draftsman.bench import load_prompt_set
    from draftsman.models import load_target
    from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer

    path = args.target or str(reference_pair()[0])
    torch.set_grad_enabled(False)
    target = load_target(path, device="cpu", dtype=torch.float32)
    tok = load_tokenizer(path)
    eos = frozenset(eos_token_ids(path, target.config.eos_token_ids, tok))
    drafter = None
    if args.drafter:
        from draftsman.models.eagle3 import load_drafter

        dpath = str(reference_pair()[1]) if args.drafter == "reference" else args.drafter
        drafter = load_drafter(dpath, target=target, device="cpu", dtype=torch.float32, inference=True)
    runs = []
    for name in args.datasets.split(","):
        prompts = [encode_prompt(tok, t, chat=True) for t in load_prompt_set(name, args.num_prompts)]
        for t in (float(x) for x in args.temperatures.split(",")):
            row = {"dataset": name, "temperature": t,
                   **ceiling(target, prompts, t, args.top_p, args.topk, args.max_new_tokens, eos, args.seed)}
            if drafter is not None:
                row["arms"] = drafter_acceptance(target, drafter, prompts, t, args.top_p, args.max_new_tokens, eos,
                                                 args.seed)
            runs.append(row)
            print(json.dumps(row), file=sys.stderr)
            result = {"target": "reference" if args.target is None else args.target, "drafter": args.drafter,
                      "topk": args.topk,
                      "top_p": args.top_p, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                      "runs": runs}
            write_results(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
