"""Drafter training end to end on a tiny target: it learns (loss, accuracy, tau in the engine),
resumes exactly, gives the same losses on 1 and 2 processes, offline states equal online ones,
and the CLI commands work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import draftsman
from draftsman.generate import StopRules, generate_plain
from draftsman.models.eagle3 import init_drafter, load_drafter
from draftsman.spec.engine import SpecConfig, SpecEngine
from draftsman.train.data import TokenizedConversation
from draftsman.train.trainer import (
    DistInfo,
    OnlineSource,
    TrainConfig,
    evaluate,
    global_batch,
    lr_factor,
    rank_micro_batches,
    train,
)
from draftsman.train.vocab import build_vocab_mapping

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = [f"w{i}" for i in range(120)]
STEPS = 3
AUX = (1, 2, 4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread is several times faster than two fighting over a busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A 4-layer Llama with a peaked next-token distribution (lm_head scaled), so there is
    something to learn, and a word-level ChatML tokenizer for the CLI."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)
    path = tmp_path_factory.mktemp("peaked")
    hf.save_pretrained(path)
    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    return draftsman.load_target(target_dir)


@pytest.fixture(scope="module")
def generated(target):
    """Target-written data: random prompts, greedy answers; loss mask on the answers."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(416)]
    answers = generate_plain(target, prompts, StopRules(max_new_tokens=20)).token_ids
    ex = [TokenizedConversation(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers, strict=True)]
    return ex[:400], ex[400:], prompts[400:]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Conversations in prepare-data's layout (random words) for the CLI tests."""
    g = torch.Generator().manual_seed(1)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with path.open("w") as f:
        for i in range(16):
            msgs = [{"role": "user", "content": words(5)}, {"role": "assistant", "content": words(12)}]
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return path


def config(target_dir, out, **kw) -> TrainConfig:
    base = dict(target=str(target_dir), out=str(out), ttt_steps=STEPS, batch_size=8, micro_batch_size=4,
                lr=3e-3, draft_vocab_size=192, warmup_ratio=0.05, device="cpu", progress=False)
    return TrainConfig(**(base | kw))


def read_log(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "train_log.jsonl").read_text().splitlines()]


# ---- pure pieces ----------------------------------------------------------------------------------
def test_data_order_is_deterministic_and_covers_each_epoch():
    e0 = [global_batch(20, 4, seed=7, step=s) for s in range(5)]
    assert [e for e, _ in e0] == [0] * 5
    assert sorted(i for _, b in e0 for i in b) == list(range(20))
    assert global_batch(20, 4, seed=7, step=5)[0] == 1
    assert global_batch(20, 4, seed=7, step=3) == e0[3]
    assert global_batch(20, 4, seed=8, step=0) != e0[0]


def test_rank_slices_partition_the_global_batch():
    batch = list(range(8))
    lengths = [5, 1, 7, 3, 2, 8, 6, 4]
    parts = [rank_micro_batches(batch, lengths, DistInfo(r, 2, r), 2) for r in range(2)]
    flat = sorted(i for p in parts for mb in p for i in mb)
    assert flat == batch
    assert all(len(mb) == 2 for p in parts for mb in p)


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10) == pytest.approx(0.0)


# ---- learning ---------------------------------------------------------------------------------------
def test_training_lowers_loss_raises_accuracy_and_tau(target_dir, target, generated, tmp_path):
    train_ex, held_ex, held_prompts = generated
    # aux layer 4 = the last layer's output: step 0 is learnable in a few hundred tiny steps
    cfg = config(target_dir, tmp_path / "run", max_steps=250, micro_batch_size=8, lr=1e-2,
                 aux_layers=AUX)
    res = train(cfg, examples=train_ex)
    assert not res.interrupted and res.global_step == 250
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    print(f"loss first {first:.3f} last {last:.3f}")

    mapping = build_vocab_mapping(train_ex, 256, 192)
    untrained = init_drafter(target, draft_vocab_size=192, aux_layer_ids=AUX,
                             draft_token_ids=mapping.draft_token_ids, seed=cfg.seed)
    trained = load_drafter(tmp_path / "run", target=target)
    src = OnlineSource(held_ex, target, trained.aux_layer_ids)
    src.set_draft_vocab(trained.draft_token_ids)
    before = evaluate(untrained, src, range(len(held_ex)), STEPS)
    after = evaluate(trained, src, range(len(held_ex)), STEPS)
    print("before", before)
    print("after", after)

    rules = StopRules(max_new_tokens=20)
    plain = generate_plain(target, held_prompts, rules)
    taus = {}
    for name, d in (("untrained", untrained), ("trained", trained)):
        out = SpecEngine(target, d, SpecConfig.chain(STEPS)).generate(held_prompts, rules)
        assert out.token_ids == plain.token_ids  # still lossless
        taus[name] = out.stats["accept_length"]
    print("tau", taus)
    # measured (CPU, fp32): loss 12.8 -> 7.7; step-0 acceptance 0.01 -> 0.48; tau_pred 1.01 -> 1.82,
    # tau_chain -> 2.2; engine tau (chain of 3) 1.00 -> 1.74
    assert last < first - 3.0
    assert before["acceptance_per_step"][0] < 0.05
    assert after["acceptance_per_step"][0] > 0.35
    assert after["tau_pred"] > before["tau_pred"] + 0.5
    assert taus["untrained"] < 1.1
    assert taus["trained"] > 1.5


# ---- resume -----------------------------------------------------------------------------------------
def _weights(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(out) / "model.safetensors"))


def test_interrupt_and_resume_is_exact(target_dir, generated, tmp_path):
    """8 steps straight == 4 steps, stop, --resume to 8 (crossing an epoch boundary): same loss
    sequence and bitwise-equal final weights."""
    ex = generated[0][:48]
    kw = dict(max_steps=8, save_every=3)
    straight = train(config(target_dir, tmp_path / "a", **kw), examples=ex)
    part = train(config(target_dir, tmp_path / "b", stop_after=4, **kw), examples=ex)
    assert part.interrupted and part.global_step == 4
    assert not (tmp_path / "b" / "model.safetensors").exists()  # not final yet
    with pytest.raises(ValueError, match="--resume"):
        train(config(target_dir, tmp_path / "b", **kw), examples=ex)
    rest = train(config(target_dir, tmp_path / "b", resume=True, **kw), examples=ex)
    assert rest.global_step == 8 and not rest.interrupted
    a, b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert straight.losses == pytest.approx(part.losses + rest.losses, abs=1e-6)
    # atomic layout: no temporary directories left, training state beside the drafter
    assert not list((tmp_path / "b" / "checkpoints").glob(".tmp*"))
    state = torch.load(tmp_path / "b" / "training_state" / "training_state.pt", weights_only=True)
    assert state["global_step"] == 8 and set(state) >= {"model", "optimizer", "scheduler", "rng"}


def test_init_refuses_contradicting_flags(target_dir, target, generated, tmp_path):
    d = init_drafter(target, draft_vocab_size=64, aux_layer_ids=(1, 2, 3), seed=0)
    from draftsman.models.eagle3 import save_drafter

    save_drafter(d, tmp_path / "init")
    ex = generated[0][:16]
    with pytest.raises(ValueError, match="aux layer ids"):
        train(config(target_dir, tmp_path / "o1", init=str(tmp_path / "init"), aux_layers=(1, 2, 4),
                     max_steps=1, draft_vocab_size=None), examples=ex)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        train(config(target_dir, tmp_path / "o2", init=str(tmp_path / "init"), max_steps=1), examples=ex)
    res = train(config(target_dir, tmp_path / "o3", init=str(tmp_path / "init"), max_steps=2,
                       draft_vocab_size=None), examples=ex)
    tuned = load_drafter(tmp_path / "o3", target=target)
    assert tuned.aux_layer_ids == (1, 2, 3) and torch.equal(tuned.d2t, d.d2t)
    assert res.global_step == 2


# ---- CLI, processes, offline states ------------------------------------------------------------------
def cli(capsys, *args: str) -> str:
    """`draftsman ARGS` in this process (same parser and code path as the console script)."""
    from draftsman.cli import main

    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out


def train_args(target_dir, data_file, out, *extra: str) -> list[str]:
    return ["train", "--target", str(target_dir), "--data", str(data_file), "--out", str(out), "--ttt-steps", "2",
            "--batch-size", "4", "--micro-batch-size", "1", "--max-steps", "3", "--lr", "1e-2",
            "--draft-vocab-size", "100", "--device", "cpu", "--no-progress", *extra]


def test_cli_train_then_eval_drafter(target_dir, target, data_file, tmp_path, capsys):
    out = tmp_path / "cli"
    summary = json.loads(cli(capsys, *train_args(target_dir, data_file, out), "--json").strip().splitlines()[-1])
    assert summary["global_step"] == 3 and len(summary["losses"]) == 3
    drafter = load_drafter(out, target=target)
    assert drafter.config.draft_vocab_size == 100 and len(read_log(out)) == 3
    ev = cli(capsys, "eval-drafter", "--target", str(target_dir), "--drafter", str(out), "--data", str(data_file),
             "--ttt-steps", "2", "--num-samples", "8", "--device", "cpu", "--json")
    got = json.loads(ev.strip().splitlines()[-1])
    assert set(got) == {"num_samples", "ttt_steps", "positions_per_step", "acceptance_per_step", "tau_pred",
                        "chain_acceptance", "tau_chain", "draft_vocab_coverage", "loss_per_step"}
    assert got["num_samples"] == 8 and len(got["acceptance_per_step"]) == 2
    assert 1.0 <= got["tau_pred"] <= 3.0


@pytest.fixture(scope="module")
def one_process_run(target_dir, data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run"
    from draftsman.cli import main

    assert main(train_args(target_dir, data_file, out)) == 0
    return out


@pytest.fixture(scope="module")
def two_process_runs(target_dir, data_file, tmp_path_factory) -> dict[str, Path]:
    """One `torchrun --nproc-per-node 2` (gloo, CPU) that runs `draftsman train` under DDP, then
    under FSDP2 (one launch: process start-up dominates on a small CPU)."""
    root = tmp_path_factory.mktemp("two")
    outs = {"ddp": root / "ddp", "fsdp": root / "fsdp"}
    script = root / "run_both.py"
    runs = [train_args(target_dir, data_file, outs["ddp"]), train_args(target_dir, data_file, outs["fsdp"], "--fsdp")]
    script.write_text("from draftsman.cli import main\n"
                      f"for args in {runs!r}:\n"
                      "    assert main(args) == 0\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return outs


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(two_process_runs, mode, one_process_run):
    """2 processes reproduce the 1-process losses and weights: the global batch is the same, each
    rank takes half of it and the loss is averaged over the whole batch's masked positions."""
    one, two = read_log(one_process_run), read_log(two_process_runs[mode])
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-5)
        assert a["positions_per_step"] == b["positions_per_step"]
    wa, wb = _weights(one_process_run), _weights(two_process_runs[mode])
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)


def test_dump_hidden_then_offline_training_matches_online(target_dir, data_file, tmp_path, capsys,
                                                          one_process_run):
    states = tmp_path / "states"
    dump = ["dump-hidden", "--target", str(target_dir), "--data", str(data_file), "--out", str(states),
            "--shard-size", "5", "--batch-size", "3", "--device", "cpu", "--dtype", "float32"]
    cli(capsys, *dump)
    index = json.loads((states / "index.json").read_text())
    assert index["complete"] and index["num_examples"] == 16 and len(index["shards"]) == 4
    assert index["aux_layer_ids"] == [2, 2, 1] and index["dtype"] == "float32"
    # resumable by shard: a lost shard is rewritten identically, the others are kept
    from safetensors.torch import load_file

    before = load_file(str(states / "shard-00001.safetensors"))
    (states / "shard-00001.safetensors").unlink()
    cli(capsys, *dump)
    after = load_file(str(states / "shard-00001.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(SystemExit, match="other inputs"):
        cli(capsys, *dump, "--max-length", "30")

    cli(capsys, *dump[:6], str(tmp_path / "states_logits"), *dump[7:], "--with-logits")
    on = read_log(one_process_run)
    for name, d in (("hidden", states), ("logits", tmp_path / "states_logits")):
        args = train_args(target_dir, data_file, tmp_path / f"offline_{name}")
        args[args.index("--data") : args.index("--data") + 2] = ["--hidden-dir", str(d)]
        cli(capsys, *args)
        off = read_log(tmp_path / f"offline_{name}")
        for a, b in zip(on, off, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["positions_per_step"] == b["positions_per_step"]


def test_sigint_stops_cleanly_with_a_checkpoint(target_dir, generated, tmp_path):
    """Ctrl-C mid-run: the current step finishes, a checkpoint is written, --resume continues."""
    import signal
    import threading

    ex = generated[0][:48]
    kw = dict(max_steps=10_000, micro_batch_size=8)
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        res = train(config(target_dir, tmp_path / "run", **kw), examples=ex)
    finally:
        timer.cancel()
    assert res.interrupted and 0 < res.global_step < 10_000
    assert (tmp_path / "run" / "checkpoints" / f"step-{res.global_step:07d}").is_dir()
    assert len(read_log(tmp_path / "run")) == res.global_step
    more = train(config(target_dir, tmp_path / "run", resume=True, stop_after=1, **kw), examples=ex)
    assert more.global_step == res.global_step + 1


def test_train_scaling_benchmark_runs_the_arms_and_compares_them(target_dir, data_file, tmp_path):
    """benchmarks/train_scaling.py (issue 8's run) on CPU over gloo: one process against DDP on
    two, online and offline, same losses, τ measured with each trained drafter."""
    script = Path(__file__).parents[1] / "benchmarks" / "train_scaling.py"
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, str(script), "--target", str(target_dir), "--data", str(data_file), "--device", "cpu",
           "--nproc", "2", "--modes", "ddp", "--steps", "2", "--skip-steps", "1", "--batch-size", "4",
           "--micro-batch-size", "1", "--max-length", "64", "--tau-prompts", "1", "--tau-new-tokens", "8",
           "--train-args", "--ttt-steps 2 --draft-vocab-size 100 --lr 1e-2", "--work", str(tmp_path / "work"),
           "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["init"] == "none" and set(got["runs"]) == {"online", "offline"}
    for source in ("online", "offline"):
        runs, fig = got["runs"][source], got["figures"][source]["ddp"]
        assert len(runs["single"]["losses"]) == len(runs["ddp"]["losses"]) == 2
        assert runs["ddp"]["timed_steps"] == 1 and runs["ddp"]["tokens_per_s"] > 0
        assert fig["losses_match"] and fig["same_positions"] and fig["loss_max_rel_diff"] < 1e-4
        assert fig["scaling_efficiency"] == pytest.approx(
            runs["ddp"]["tokens_per_s"] / (2 * runs["single"]["tokens_per_s"]))
        assert fig["tau"] >= 1.0 and fig["tau_single"] >= 1.0
    # offline trains on the dumped states: the same losses as online
    assert got["runs"]["offline"]["single"]["losses"] == pytest.approx(got["runs"]["online"]["single"]["losses"],
                                                                        rel=1e-5)


def test_the_cli_ends_a_torchrun_rank_through_exit_distributed(monkeypatch):
    """`draftsman` / `python -m draftsman.cli` (cli.run) leaves a process with a process group
    through trainer.exit_distributed (a rank left to interpreter exit aborted in CI after
    training was done); without a group it exits with main's code."""
    import torch.distributed as dist

    import draftsman.cli as cli
    import draftsman.train.trainer as trainer

    exits = []
    monkeypatch.setattr(cli, "main", lambda: 0)
    monkeypatch.setattr(trainer, "exit_distributed", lambda code: exits.append(code))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(SystemExit) as e:
        cli.run()
    assert exits == [0] and e.value.code == 0
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(cli, "main", lambda: 3)
    with pytest.raises(SystemExit) as e:
        cli.run()
    assert exits == [0] and e.value.code == 3
