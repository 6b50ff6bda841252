"""vLLM's offline engine on token-id prompts, greedy, with or without an EAGLE-3 drafter: the
output token ids and the speculation counters (run with the python of the vLLM virtual
environment; tests/test_vllm.py drives it).

    $DRAFTSMAN_VLLM_PYTHON recipes/vllm-cpu/offline.py --target DIR --prompts prompts.json \\
        [--drafter EXPORT --steps 3] --max-tokens 32

prompts.json: a list of token-id lists. Prints one line "RESULT " + JSON (vLLM logs to stdout too) {"outputs": [[ids]], "drafts",
"draft_tokens", "accepted", "accepted_per_pos": [...]} (counters 0 without a drafter). Every
answer runs to --max-tokens (ignore_eos), so engines compare token for token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def counters(metrics) -> dict:
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = list(m.values)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--drafter")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None if args.drafter is None else {"method": "eagle3", "model": args.drafter,
                                              "num_speculative_tokens": args.steps}
    llm = LLM(model=args.target, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              speculative_config=spec, disable_log_stats=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(args.prompts).read_text())]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    print("RESULT " + json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs]} | counters(llm.get_metrics())))


if __name__ == "__main__":  # vLLM's engine spawns a process: the LLM must be made under this guard
    main()
