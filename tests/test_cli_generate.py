"""`draftsman generate` end to end through the console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import hf_greedy
from transformers import LlamaForCausalLM


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsman.cli", *args], capture_output=True, text=True,
                          timeout=300)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def make_tokenizer(path):
    """A tiny word-level tokenizer with a chat template, saved the HF way."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>", "user", "assistant", ":", "hello", "world", "how", "are", "you"]
    words += [f"w{i}" for i in range(256 - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(path)
    return fast


def test_generate_json_prompt_ids_matches_hf(tiny_llama_dir):
    res = run_cli("generate", "--target", str(tiny_llama_dir), "--prompt-ids", "5,6,7,8",
                  "--max-new-tokens", "12", "--json")
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    expected = hf_greedy(hf, torch.tensor([[5, 6, 7, 8]]), 12).tolist()
    eos = 2
    if eos in expected:  # generation stops at (and includes) EOS
        expected = expected[: expected.index(eos) + 1]
    assert out["token_ids"] == expected
    assert out["num_new_tokens"] == len(expected)
    assert out["time_s"] > 0 and out["tokens_per_s"] > 0
    assert "text" not in out  # no tokenizer in this checkpoint


def test_generate_text_chat_and_batch(tiny_llama_dir, tmp_path):
    d = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    tok = make_tokenizer(d)
    res = run_cli("generate", "--target", str(d), "--prompt", "hello world", "--prompt", "how are you",
                  "--chat", "--max-new-tokens", "6", "--json")
    assert res.returncode == 0, res.stderr
    out = last_json(res.stdout)
    assert len(out["token_ids"]) == 2 and len(out["text"]) == 2
    assert out["text"][0] == tok.decode(out["token_ids"][0], skip_special_tokens=True)
    # the batched row equals the same prompt decoded alone (padding does not leak)
    alone = run_cli("generate", "--target", str(d), "--prompt", "how are you", "--chat",
                    "--max-new-tokens", "6", "--json")
    assert last_json(alone.stdout)["token_ids"] == out["token_ids"][1]


def test_sampling_is_reproducible_with_seed(tiny_llama_dir):
    args = ("generate", "--target", str(tiny_llama_dir), "--prompt-ids", "3,4", "--max-new-tokens", "10",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "7", "--json")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert last_json(a.stdout)["token_ids"] == last_json(b.stdout)["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--prompt", "hi"], "no tokenizer"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,99999"], "must lie in"),
])
def test_generate_bad_input_is_explained(tiny_llama_dir, args, message):
    res = run_cli("generate", "--target", str(tiny_llama_dir), *args)
    assert res.returncode != 0
    assert message in res.stderr


def test_help_lists_generate():
    res = run_cli("--help")
    assert res.returncode == 0 and "generate" in res.stdout


def test_generate_speculates_adaptively_by_default(tiny_llama_dir, tmp_path):
    """With --drafter and no --spec-* flags, generate is adaptive over DEFAULT_CANDIDATES and says
    how many rounds of each kind every request took; --spec-* flags pin one setting, which
    --spec-policy adaptive turns into the only candidate. The output is plain decoding's."""
    from dataclasses import asdict

    from draftsman.models import load_target
    from draftsman.models.eagle3 import init_drafter, save_drafter
    from draftsman.spec.adaptive import DEFAULT_CANDIDATES

    drafter = str(save_drafter(init_drafter(load_target(tiny_llama_dir), seed=1), tmp_path / "d"))
    base = ("generate", "--target", str(tiny_llama_dir), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "24",
            "--json")
    plain = last_json(run_cli(*base).stdout)
    res = run_cli(*base, "--drafter", drafter)
    assert res.returncode == 0, res.stderr
    default = last_json(res.stdout)
    assert default["token_ids"] == plain["token_ids"]
    assert default["spec"] == {"adaptive": [asdict(c) for c in DEFAULT_CANDIDATES]}
    assert 1 + default["spec_rounds"] + default["plain_rounds"] <= len(default["token_ids"])
    assert "speculative and" in res.stderr and "plain rounds" in res.stderr
    fixed = last_json(run_cli(*base, "--drafter", drafter, "--spec-steps", "3").stdout)
    assert fixed["spec"] == {"steps": 3, "topk": 4, "draft_tokens": 16}
    assert fixed["plain_rounds"] == 0 and fixed["spec_rounds"] > 0
    assert fixed["token_ids"] == plain["token_ids"]
    one = last_json(run_cli(*base, "--drafter", drafter, "--spec-steps", "3", "--spec-policy", "adaptive").stdout)
    assert one["spec"] == {"adaptive": [{"steps": 3, "topk": 4, "draft_tokens": 16}]}
    bad = run_cli(*base, "--spec-policy", "fixed")
    assert bad.returncode != 0 and "need --drafter" in bad.stderr
