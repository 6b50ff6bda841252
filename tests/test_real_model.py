"""A real pretrained model end to end: SmolLM2-135M-Instruct from its GGUF (tests/smollm2.py).

Conversion (draftsman's --target path for .gguf files) against transformers' own GGUF load,
logits and greedy tokens against transformers, and lossless speculation with an EAGLE-3 drafter
for this target (d2t/t2d over a draft vocabulary smaller than the target's)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from conftest import SHARED
from smollm2 import asset_cache, fetch_gguf
from test_engine import _chi2_critical

import draftsman
from draftsman.generate import StopRules, generate_plain
from draftsman.sampling import SamplingParams, warp_probs
from draftsman.spec.engine import SpecConfig, SpecEngine

pytest.importorskip("gguf", reason="reading GGUF needs the gguf package: pip install -e '.[dev]'")
pytest.importorskip("accelerate", reason="transformers loads GGUF through accelerate: pip install -e '.[dev]'")


@pytest.fixture(autouse=True, scope="module")
def _all_threads():
    """A 135M model's matmuls use both cores (conftest pins one thread for the tiny models)."""
    n = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def gguf_file():
    got = fetch_gguf()
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.fixture(scope="module")
def smollm2_dir(gguf_file, monkeypatch_module):
    """The checkpoint `--target FILE.gguf` resolves to, in a test cache that outlives the run."""
    from draftsman.target_source import resolve_target

    monkeypatch_module.setenv("DRAFTSMAN_CACHE", str(asset_cache() / "draftsman-cache"))
    return resolve_target(gguf_file)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def target(smollm2_dir):
    return draftsman.load_target(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mt_bench_prompts(smollm2_dir) -> list[list[int]]:
    """The first turns of the first 10 MT-bench questions, in the model's chat template."""
    from draftsman.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    rows = [json.loads(line) for line in (SHARED / "data/eval/mt_bench.jsonl").read_text().splitlines()[:10]]
    return [encode_prompt(tokenizer, r["turns"][0], chat=True) for r in rows]


def test_gguf_target_converts_once_into_a_plain_checkpoint(gguf_file, smollm2_dir):
    from draftsman.target_source import resolve_target

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    assert (smollm2_dir / "chat_template.jinja").exists() or "chat_template" in (
        smollm2_dir / "tokenizer_config.json").read_text()
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_target(gguf_file) == smollm2_dir  # the cache answers: no second conversion
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_converted_weights_equal_transformers_gguf_load(gguf_file, smollm2_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                  dtype=torch.float32).state_dict()
    written = load_file(smollm2_dir / "model.safetensors")
    assert set(written) == set(direct) - {"lm_head.weight"}  # tied: the embedding is written once
    for name, tensor in written.items():
        assert torch.equal(tensor, direct[name]), name


def test_logits_match_transformers(target, hf_model, mt_bench_prompts):
    """Within 1e-5 of the logits' scale: on CPU draftsman's projections run through oneDNN on
    packed weights (layers.cpu_packed_linear), which sums in another order than the MKL GEMMs
    under transformers' F.linear (measured: 1.1e-4 on logits up to 39, 3e-6 of their scale; with
    DRAFTSMAN_CPU_PACK=0 the two are bitwise equal)."""
    ids = torch.tensor([mt_bench_prompts[0]])
    with torch.no_grad():
        ours, theirs = target(ids), hf_model(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-5 * theirs.abs().max().item()


@pytest.fixture(scope="module")
def greedy_answers(target, mt_bench_prompts) -> list[list[int]]:
    return generate_plain(target, mt_bench_prompts, StopRules(max_new_tokens=64)).token_ids  # one batch of 10


def test_greedy_tokens_match_hf_generate(hf_model, mt_bench_prompts, greedy_answers):
    for prompt, ours in zip(mt_bench_prompts, greedy_answers, strict=True):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def drafter(smollm2_dir, target, mt_bench_prompts, greedy_answers, tmp_path_factory):
    """An EAGLE-3 drafter trained by draftsman's trainer (training-time test, online target
    states) to memorize the target's answers to the test prompts: drafts that are often right,
    as a test of acceptance wants, in minutes of CPU. Draft vocabulary: 4096 of the 49152 ids."""
    from draftsman.models.eagle3 import load_drafter
    from draftsman.train.data import TokenizedConversation
    from draftsman.train.hidden_store import dump_hidden
    from draftsman.train.trainer import TrainConfig, train

    examples = [TokenizedConversation(p + a, [0] * len(p) + [1] * len(a))
                for p, a in zip(mt_bench_prompts, greedy_answers, strict=True)]
    root = tmp_path_factory.mktemp("smollm2-drafter")
    # the target's states once (dump-hidden), not once a step: its forward is most of a step's time
    states = dump_hidden(target, examples, root / "states", list(target.config.default_aux_layer_ids()),
                         {"target": str(smollm2_dir)}, batch_size=10)
    out = root / "drafter"
    cfg = TrainConfig(target=str(smollm2_dir), out=str(out), hidden_dir=str(states), max_steps=30,
                      batch_size=10, micro_batch_size=10, lr=5e-3, ttt_steps=4, draft_vocab_size=4096,
                      warmup_ratio=0.0, progress=False, device="cpu", dtype="float32")
    train(cfg)
    drafter = load_drafter(out, target=target)
    assert drafter.config.draft_vocab_size == 4096 and bool(drafter.d2t.any())  # d2t/t2d in use
    return drafter


@pytest.mark.parametrize("spec", [SpecConfig.chain(4), SpecConfig(steps=3, topk=4, draft_tokens=12)],
                         ids=["chain4", "tree"])
def test_greedy_speculation_is_lossless_on_real_weights(target, drafter, mt_bench_prompts, spec):
    rules = StopRules(max_new_tokens=48, eos_ids=frozenset(target.config.eos_token_ids))
    prompts = mt_bench_prompts[:4]
    plain = generate_plain(target, prompts, rules)
    out = SpecEngine(target, drafter, spec).generate(prompts, rules)
    assert out.token_ids == plain.token_ids
    assert out.finish_reasons == plain.finish_reasons
    assert out.stats["accept_length"] > 1.2  # drafts were accepted, not only bonus tokens


def test_sampling_matches_target_distribution_on_real_weights(target, drafter, mt_bench_prompts):
    """T=1: the joint law of the first two tokens over 300 runs equals the target's own, by a
    chi-square test over the pairs the target gives enough mass (the rest pooled)."""
    prompt = min(mt_bench_prompts, key=len)
    n, top = 300, 12
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt]))[0, -1], 1.0, 0, 1.0)
        firsts = p1.topk(top).indices
        p2 = warp_probs(target(torch.tensor([[*prompt, int(t)] for t in firsts]))[:, -1], 1.0, 0, 1.0)
    expected = {(int(a), int(b)): float(p1[a] * p2[i, b]) * n
                for i, a in enumerate(firsts) for b in p2[i].topk(top).indices}
    expected = {k: v for k, v in expected.items() if v > 5}
    spec = SpecConfig(steps=2, topk=3, draft_tokens=7)
    out = SpecEngine(target, drafter, spec).generate([prompt] * n, StopRules(max_new_tokens=2),
                                                     SamplingParams(temperature=1.0, seed=0))
    counts = Counter(tuple(t[:2]) for t in out.token_ids)
    observed = {k: counts[k] for k in expected}
    stat = sum((observed[k] - e) ** 2 / e for k, e in expected.items())
    rest_o, rest_e = n - sum(observed.values()), n - sum(expected.values())
    stat += (rest_o - rest_e) ** 2 / max(rest_e, 1.0)
    assert len(expected) >= 3, expected
    assert stat < _chi2_critical(len(expected)), (stat, expected, observed)
    assert out.stats["accept_length"] > 1.2
