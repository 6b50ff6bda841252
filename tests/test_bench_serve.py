"""`draftsman bench --server-url` against a live `draftsman serve` measures the τ that in-process
mode measures for the same prompts at temperature 0 (per-response fields and /metrics alike)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from test_bench import WORDS, run_main, write_jsonl
from test_cli_generate import make_tokenizer
from test_engine import BigramDrafter
from test_serve import EOS, SPEC, LiveServer

from draftsman import bench
from draftsman.generate import StopRules
from draftsman.models import load_target
from draftsman.sampling import SamplingParams
from draftsman.serve import build_state
from draftsman.tokenizer import encode_prompt, load_tokenizer


def test_client_tau_equals_in_process(tiny_llama_dir, tmp_path):
    target_dir = shutil.copytree(tiny_llama_dir, tmp_path / "target")
    make_tokenizer(target_dir)
    tokenizer = load_tokenizer(target_dir)
    model = load_target(target_dir)
    drafter = BigramDrafter(model)  # right only sometimes: a non-trivial τ
    dataset = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": w} for w in WORDS])
    state = build_state(model, tokenizer, EOS, drafter, SPEC, max_model_len=128, max_batch_size=16,
                        model_name="bigram")
    with LiveServer(state) as server:
        before = bench.spec_counters(httpx.get(server.url + "/metrics").text)
        _, client = run_main("bench", "--server-url", server.url, "--dataset", dataset, "--max-new-tokens", "16",
                             "--concurrency", "3", "--warmup", "0", "--json")
        after = bench.spec_counters(httpx.get(server.url + "/metrics").text)

    ids = [encode_prompt(tokenizer, p, chat=True) for p in bench.load_prompt_set(dataset)]
    workload = bench.Workload(ids, StopRules(16, EOS), SamplingParams(temperature=0.0), batch_sizes=(3,))
    plain, local = bench.bench_in_process(model, drafter, [SPEC], workload)
    served = client["arms"][0]
    assert local["identical"] is True and local["accept_length"] > 1
    assert served["acceptance_source"] == "response"
    assert served["output_tokens"] == local["output_tokens"] == plain["output_tokens"]
    assert served["rounds"] == local["rounds"] and served["accepted_tokens"] == local["accepted_tokens"]
    assert served["accept_length"] == pytest.approx(local["accept_length"], abs=1e-12)
    assert served["accept_rate_per_position"] == pytest.approx(local["accept_rate_per_position"], abs=1e-4)
    assert client["accept_length"] == served["accept_length"]
    from_metrics = bench.acceptance_from_counters(before, after)  # the /metrics fallback agrees
    assert from_metrics["accept_length"] == pytest.approx(local["accept_length"], abs=1e-12)
    assert from_metrics["accept_rate_per_position"] == pytest.approx(local["accept_rate_per_position"], abs=1e-12)
