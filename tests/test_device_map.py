"""load_target(device_map=...): the pure pipeline split, and a target split over several (CPU)
devices computing exactly what the unsplit one computes: logits, aux states, cached decoding,
speculative decoding, dump-hidden; plus the CLI flags."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import greedy_cached

import draftsman
from draftsman.cli import main as cli_main
from draftsman.generate import StopRules
from draftsman.kvcache import StaticCache
from draftsman.models import (
    ShardedCache,
    check_fit,
    device_loads,
    load_target,
    place_layers,
    resolve_device_map,
)
from draftsman.models.eagle3 import init_drafter
from draftsman.spec.engine import SpecConfig, SpecEngine

CPU3 = ["cpu", "cpu", "cpu"]


# ---- the pure split -----------------------------------------------------------------------------
def test_place_layers_examples():
    assert place_layers([1] * 8, [1, 1, 1, 1]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert place_layers([1] * 8, [1]) == [0] * 8
    assert place_layers([1] * 8, [1, 3]) == [0, 0, 1, 1, 1, 1, 1, 1]
    # the embedding/lm_head on device 0 take its room: fewer layers there
    assert place_layers([1] * 8, [1, 1], home_bytes=4) == [0, 0, 1, 1, 1, 1, 1, 1]
    # a DeepSeek-like model: a small dense first layer, then big MoE layers
    assert place_layers([1, 10, 10, 10, 10, 10, 10, 10], [1, 1, 1, 1]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert place_layers([1, 1], [1, 1, 1, 1]) == [0, 1]  # more devices than layers: some stay idle
    with pytest.raises(ValueError, match="positive"):
        place_layers([1], [1, 0])


def _best_bottleneck(sizes: list[int], caps: list[float], home: int) -> float:
    """Brute force over every contiguous split (small cases)."""
    from itertools import combinations

    n, k, best = len(sizes), len(caps), float("inf")
    for cuts in combinations(range(n + 1), k - 1):
        if list(cuts) != sorted(cuts):
            continue
        bounds = [0, *cuts, n]
        loads = [sum(sizes[bounds[d]:bounds[d + 1]]) + (home if d == 0 else 0) for d in range(k)]
        best = min(best, max(load / c for load, c in zip(loads, caps, strict=True)))
    return best


def test_place_layers_is_optimal_and_contiguous():
    rng = random.Random(0)
    for _ in range(300):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        sizes = [rng.randint(1, 100) for _ in range(n)]
        caps = [rng.choice([1.0, 2.0, 0.5, 1.5]) for _ in range(k)]
        home = rng.randint(0, 150)
        out = place_layers(sizes, caps, home)
        assert len(out) == n and all(0 <= d < k for d in out)
        assert out == sorted(out)  # contiguous blocks in device order: activations only move forward
        loads = device_loads(sizes, out, k, home)
        got = max(load / c for load, c in zip(loads, caps, strict=True))
        assert got <= _best_bottleneck(sizes, caps, home) * (1 + 1e-9)


def test_resolve_device_map_and_fit():
    assert resolve_device_map(None, "cpu") == []
    if not torch.cuda.is_available():
        assert resolve_device_map("auto", "cpu") == [torch.device("cpu")]
    assert resolve_device_map("cuda:0,cuda:1", "cpu") == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_device_map(["cpu", torch.device("cpu")], "cpu") == [torch.device("cpu")] * 2
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    check_fit([5 * 2**30, 6 * 2**30], [6 * 2**30, 6 * 2**30], gpus)
    with pytest.raises(ValueError, match=r"cuda:1: 7\.0 GiB of weights, 6\.0 GiB free"):
        check_fit([5 * 2**30, 7 * 2**30], [6 * 2**30, 6 * 2**30], gpus)


def test_sharded_cache_matches_static_cache():
    """Same slot semantics: writes, reads, compaction, rows leaving and joining."""
    layout = {"k": (2, 3), "v": (2, 3)}
    a = StaticCache.allocate(layout, 3, 2, 8, "cpu", torch.float32)
    b = ShardedCache.allocate_layers(layout, [torch.device("cpu")] * 3, 2, 8, torch.float32)
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 1, 2, 5], [1, 2, 3, 4]])
    for layer in range(3):
        vals = {n: torch.randn(2, 4, 2, 3, generator=g) for n in layout}
        a.write(layer, idx, **vals)
        b.write(layer, idx, **vals)
    a.compact(torch.tensor([[5], [4]]), torch.tensor([[3], [5]]))
    b.compact(torch.tensor([[5], [4]]), torch.tensor([[3], [5]]))
    extra_a = StaticCache.allocate(layout, 3, 1, 8, "cpu", torch.float32)
    extra_b = ShardedCache.allocate_layers(layout, [torch.device("cpu")] * 3, 1, 8, torch.float32)
    a.append_rows(extra_a)
    b.append_rows(extra_b)
    a.select_rows(torch.tensor([2, 0]))
    b.select_rows(torch.tensor([2, 0]))
    assert (a.batch_size, a.max_len) == (b.batch_size, b.max_len) and a.nbytes() == b.nbytes()
    for layer in range(3):
        for n in layout:
            assert torch.equal(a.read(layer, n, 8), b.read(layer, n, 8))


# ---- a split target -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(tiny_llama_dir), load_target(tiny_llama_dir, device_map=CPU3)


def test_split_llama_computes_the_same(llama):
    plain, split = llama
    # home (embedding + lm_head, about one layer's bytes) and layer 0 on device 0, then 2 + 1 layers:
    # the layers off device 0 carry the hooks that move activations there and back
    assert [bool(layer._forward_pre_hooks) for layer in split.layers] == [False, True, True, True]
    assert len(split.layer_devices) == 4
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    p, s = plain.run(ids, aux_layer_ids=[0, 2, 4]), split.run(ids, aux_layer_ids=[0, 2, 4])
    assert torch.equal(p.logits, s.logits)
    for x, y in zip(p.aux_hidden, s.aux_hidden, strict=True):
        assert torch.equal(x, y)
    cache = split.new_cache(1, 16)
    assert isinstance(cache, ShardedCache) and cache.num_layers == 4
    assert torch.equal(greedy_cached(plain, ids[:1], 6), greedy_cached(split, ids[:1], 6))


def test_split_target_speculates_the_same(llama):
    plain, split = llama
    prompts = [[5, 9, 17, 33], [7, 7, 40, 2, 90, 11, 3]]
    rules, spec = StopRules(max_new_tokens=10), SpecConfig(steps=3, topk=2, draft_tokens=6)
    outs = []
    for target in (plain, split):
        drafter = init_drafter(target, aux_layer_ids=(1, 2, 3), seed=0, std=0.3)
        res = SpecEngine(target, drafter, spec).generate(prompts, rules)
        outs.append((res.token_ids, res.stats["accept_length"]))
    assert outs[0] == outs[1]


def test_staged_prefills_leave_a_split_target_eager(llama):
    """graph_prefill on a target split over devices (per-layer caches, no staging buffers):
    prefills stay eager and decode the same."""
    from draftsman.sampling import SamplingParams
    from draftsman.session import PlainSession, run_to_completion

    plain, split = llama
    prompts = [[5, 9, 17, 33], [7, 7, 40, 2, 90, 11, 3]]
    outs = []
    for target, staged in ((plain, False), (split, True)):
        session = PlainSession(target, 32)
        session.static = session.pad = session.graph_prefill = staged
        done = run_to_completion(session, prompts, StopRules(max_new_tokens=8), SamplingParams(temperature=0.0))
        outs.append([r.state.tokens for r in done])
        assert not session._staging
    assert outs[0] == outs[1]


def test_split_deepseek_mla_cache(tiny_deepseek_dir):
    plain = load_target(tiny_deepseek_dir)
    split = load_target(tiny_deepseek_dir, device_map="cpu,cpu")
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(plain(ids), split(ids))
    assert torch.equal(greedy_cached(plain, ids, 5), greedy_cached(split, ids, 5))


# ---- CLI flags ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama with a word-level ChatML tokenizer, and a few conversations."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("chat")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 eos_token_id=2)).save_pretrained(path)
    words = [f"w{i}" for i in range(100)]
    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    data = path / "data.jsonl"
    with data.open("w") as f:
        for i in range(4):
            f.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"},
                                                           {"role": "assistant", "content": f"w{i + 3} w{i + 9}"}]}) + "\n")
    return path, data


def test_dump_hidden_with_device_map_writes_the_same_states(chat_target, tmp_path):
    from safetensors.torch import load_file

    target, data = chat_target
    for name, extra in (("plain", []), ("split", ["--device-map", "cpu,cpu"])):
        rc = cli_main(["dump-hidden", "--target", str(target), "--data", str(data), "--out", str(tmp_path / name),
                       "--device", "cpu", "--aux-layers", "1,2,3", *extra])
        assert rc == 0
    shards = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert shards
    for shard in shards:
        a, b = load_file(tmp_path / "plain" / shard), load_file(tmp_path / "split" / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prepare_data_and_train_take_the_flag(chat_target, tmp_path):
    target, data = chat_target
    out = tmp_path / "regen.jsonl"
    assert cli_main(["prepare-data", "--target", str(target), "--input", str(data), "--output", str(out),
                     "--max-new-tokens", "4", "--device", "cpu", "--device-map", "cpu,cpu"]) == 0
    assert len(out.read_text().splitlines()) == 4
    assert cli_main(["train", "--target", str(target), "--data", str(out), "--out", str(tmp_path / "d"),
                     "--max-steps", "1", "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab-size", "64",
                     "--device", "cpu", "--device-map", "cpu,cpu", "--no-progress"]) == 0
    assert (tmp_path / "d" / "model.safetensors").exists()
    assert draftsman.load_drafter(tmp_path / "d").aux_layer_ids is not None
