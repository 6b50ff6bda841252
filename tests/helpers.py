"""Test utilities (not fixtures)."""

from __future__ import annotations

import torch


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
