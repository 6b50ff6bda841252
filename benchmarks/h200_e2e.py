"""End-to-end speed of a pair (default: the embedded reference pair; --target/--drafter for
another, e.g. SmolLM2 and its drafter) against HF transformers on the same weights:
draftsman's plain decoding and speculation (`draftsman bench`, default tree), HF `generate`, and
HF's assisted generation in the form that can run without a second HF model (prompt lookup:
n-gram drafts from the prompt; HF's model-based assisted generation needs an HF causal LM as the
assistant, which an EAGLE-3 drafter is not). Same prompts (chat template), same dtype, batch 1,
--max-new-tokens each, EOS stops every arm.

    python benchmarks/h200_e2e.py --out benchmarks/results/h200_e2e.json

Speed-ups are tokens/s ratios of arms of the same run. Prints one JSON line; --out keeps it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from h200_json import write_results  # benchmarks/ is on sys.path when run as a script
from reference_pair import run_bench

from draftsman.bench import load_prompt_set
from draftsman.tokenizer import encode_prompt, eos_token_ids, load_tokenizer


def hf_arm(model, prompts: list[list[int]], new_tokens: int, temperature: float, eos: list[int], **extra) -> dict:
    """tokens/s of HF generate over the prompts one at a time (after one warm-up call)."""
    device = model.device
    kw = dict(max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos[0], **extra)
    kw |= {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    model.generate(torch.tensor([prompts[0]], device=device), **kw)
    tokens, seconds = 0, 0.0
    for p in prompts:
        ids = torch.tensor([p], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t
        tokens += out.shape[1] - ids.shape[1]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--datasets", default="mt-bench,humaneval,gsm8k")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--target", help="default: the embedded reference target")
    ap.add_argument("--drafter", help="default: the embedded reference drafter")
    ap.add_argument("--out")
    args = ap.parse_args()
    if (args.target is None) != (args.drafter is None):
        ap.error("give both --target and --drafter, or neither (the embedded pair)")
    import transformers

    from draftsman import reference_pair

    target, drafter = (args.target, args.drafter) if args.target else (str(p) for p in reference_pair())
    tokenizer = load_tokenizer(target)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, args.dtype)).to(args.device)
    hf.eval()
    eos = sorted(eos_token_ids(target, (), tokenizer))
    res: dict = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
                 "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
                 "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "runs": []}
    if args.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    for dataset in args.datasets.split(","):
        prompts = [encode_prompt(tokenizer, t, chat=True) for t in load_prompt_set(dataset, args.num_prompts)]
        for temperature in (float(t) for t in args.temperatures.split(",")):
            bench, _ = run_bench(["--dataset", dataset, "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                                  str(args.max_new_tokens), "--temperature", str(temperature), "--device",
                                  args.device, "--dtype", args.dtype], target, drafter)
            arms = {a["arm"]: a for a in bench["arms"]}
            tree = next(a for a in bench["arms"] if a["kind"] == "spec" and a["spec"]["draft_tokens"] == 16)
            row = {"dataset": dataset, "temperature": temperature,
                   "draftsman_plain": arms["plain"]["tokens_per_s"], "draftsman_spec": tree["tokens_per_s"],
                   "draftsman_spec_arm": tree["arm"], "accept_length": tree["accept_length"]}
            with torch.no_grad():
                row["hf_generate"] = hf_arm(hf, prompts, args.max_new_tokens, temperature, eos)["tokens_per_s"]
                try:
                    row["hf_prompt_lookup"] = hf_arm(hf, prompts, args.max_new_tokens, temperature, eos,
                                                     prompt_lookup_num_tokens=args.prompt_lookup_tokens)["tokens_per_s"]
                except Exception as e:  # e.g. a transformers version without it for sampling
                    row["hf_prompt_lookup_error"] = repr(e)[:300]
            row["spec_over_draftsman_plain"] = row["draftsman_spec"] / row["draftsman_plain"]
            row["spec_over_hf_generate"] = row["draftsman_spec"] / row["hf_generate"]
            row["draftsman_plain_over_hf_generate"] = row["draftsman_plain"] / row["hf_generate"]
            if "hf_prompt_lookup" in row:
                row["spec_over_hf_prompt_lookup"] = row["draftsman_spec"] / row["hf_prompt_lookup"]
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            write_results(args.out, res)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
