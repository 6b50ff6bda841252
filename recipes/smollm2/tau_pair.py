"""τ (accept length) of several drafters of one target, engine-measured, without the plain arm:
the lean form of benchmarks/reference_pair.py for a machine too busy to time four arms.

For each prompt set and temperature, every drafter decodes the same prompts (batch 1, one
request at a time, the speculative session `draftsman bench` uses, seed reset before each
drafter), and its rounds' accepted drafts give τ and the acceptance per position, as bench
reports them. No warm-up and no timing: τ does not depend on them.

    python recipes/smollm2/tau_pair.py --target SMOLLM2_DIR --drafters old=DIR1,new=DIR2 \
        --datasets mt-bench,humaneval,gsm8k --temperatures 1,0 --num-prompts 10 --max-new-tokens 64 \
        --out tau_pair.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draftsman import bench
from draftsman.cli import resolve_device, resolve_dtype
from draftsman.generate import StopRules
from draftsman.models import load_target
from draftsman.models.eagle3 import load_drafter
from draftsman.sampling import SamplingParams
from draftsman.spec.engine import SpecConfig
from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafters", required=True, help="NAME=DIR,NAME=DIR,...")
    ap.add_argument("--datasets", default="mt-bench,humaneval,gsm8k")
    ap.add_argument("--temperatures", default="1,0")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--spec", default="5,4,16", help="steps,topk,draft_tokens (default: bench's default tree)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="JSON, rewritten after every run")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    spec = SpecConfig(*(int(x) for x in args.spec.split(",")))
    tokenizer = load_tokenizer(args.target)
    target = load_target(args.target, device=device, dtype=dtype)
    drafters = {name: load_drafter(path, target=target, device=device, dtype=dtype, inference=True)
                for name, path in (kv.split("=", 1) for kv in args.drafters.split(","))}
    rules = StopRules(args.max_new_tokens, frozenset(eos_token_ids(args.target, target.config.eos_token_ids, tokenizer)))
    result = {"target": args.target, "drafters": args.drafters, "device": str(device), "dtype": str(dtype),
              "spec": vars(spec), "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
              "seed": args.seed, "runs": []}
    for temp in (float(t) for t in args.temperatures.split(",")):
        for name in args.datasets.split(","):
            ids = [encode_prompt(tokenizer, text, chat=True) for text in bench.load_prompt_set(name, args.num_prompts)]
            params = SamplingParams(temperature=temp, seed=args.seed)
            workload = bench.Workload(ids, rules, params, (1,), 0, args.seed)
            for dname, drafter in drafters.items():
                torch.manual_seed(args.seed)
                t0 = time.perf_counter()
                session = bench.make_session(target, drafter, spec, workload)
                run = bench.drive_session(session, bench._requests(ids, workload), 1)
                acc = bench.acceptance_from_histograms((r.histogram for r in run.requests), spec)
                row = {"dataset": name, "temperature": temp, "drafter": dname,
                       "accept_length": acc["accept_length"], "accept_rate_per_position": acc["accept_rate_per_position"],
                       "rounds": acc.get("rounds"), "tokens": sum(t.num_tokens for t in run.traces),
                       "seconds": round(time.perf_counter() - t0, 1)}
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
