"""Check a reference-target checkpoint: HF transformers loads it and generates, and draftsman's
own DeepSeek-V3 computes the same logits (fp32, CPU).

    python recipes/reference/check_checkpoint.py recipes/reference/out/target

Prints one JSON line: transformers version, max |logit difference| HF vs draftsman (must be
< 1e-4), greedy agreement over the generated text, and HF's greedy answer to a chat prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
    {"role": "assistant", "content": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"},
    {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in total?"},
    {"role": "assistant", "content": "In May she sold 48 / 2 = 24 clips, so 48 + 24 = 72 in total.\n#### 72"},
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", default="How do I sort a list in Python?")
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--no-draftsman", action="store_true", help="only check HF transformers")
    args = ap.parse_args(argv)

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.checkpoint)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        gen = hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    report = {"transformers": transformers.__version__, "class": type(hf).__name__,
              "parameters": sum(p.numel() for p in hf.parameters()),
              "ended_with_eos": bool(gen[0, -1] == tok.eos_token_id), "generated_tokens": gen.shape[1] - ids.shape[1]}
    if not args.no_draftsman:
        import draftsman

        ours = draftsman.load_target(path)
        # Logits over the prompt plus HF's own continuation, and over a 512-token multi-turn
        # chat (128 random tokens for a second row), the length the model was trained at.
        torch.manual_seed(0)
        chat = tok.apply_chat_template(CHAT, tokenize=False)
        long = tok.encode(chat * 8, add_special_tokens=False)[:512]
        rows = torch.stack([torch.tensor(long), torch.cat([torch.tensor(long[:384]),
                                                         torch.randint(6, len(tok), (128,))])])
        diff, agree = 0.0, []
        with torch.no_grad():
            for x in (gen, rows):
                ref, got = hf(x).logits, ours(x)
                diff = max(diff, (ref - got).abs().max().item())
                agree.append((ref.argmax(-1) == got.argmax(-1)).float().flatten())
        report.update(max_abs_logit_diff=diff, compared_positions=int(sum(a.numel() for a in agree)),
                      argmax_agreement=float(torch.cat(agree).mean()), draftsman_matches=diff < args.tol)
    report["prompt"], report["answer"] = args.prompt, answer
    print(json.dumps(report, ensure_ascii=False))
    if not args.no_draftsman and not report["draftsman_matches"]:
        sys.exit(f"draftsman logits differ from HF by {diff:.3g} (tolerance {args.tol})")


if __name__ == "__main__":
    main()
