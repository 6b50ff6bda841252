"""`draftsman doctor` on a tiny trained pair: the healthy pair passes, and each planted fault is
flagged with its cause (static check, convention probe, live acceptance, verdict).

The pair. A random 8-layer Llama is bigram-like: its greedy answers fall into one- or two-token
cycles that a drafter predicts from the token alone, so it would never need the aux hidden states
and layer faults would be invisible. The target below is still random, but (1) attention and MLPs
are strengthened (layers 1, 4 and 7 most) so its next token depends on context, (2) the top
principal directions of its final states are removed from lm_head so no "hub" token wins
everywhere (lm_head x20 keeps it peaked), (3) the residual stream is 16x larger and the
final-norm weights are spread over orders of magnitude (lm_head compensates: the function is
unchanged), so, as in a real LLM, the normed last state points elsewhere than the raw one. The
EAGLE-3 drafter is then trained by draftsman's trainer on target-written answers, with
non-default aux layers (2, 5, 8), a reduced draft vocabulary (the 32 most frequent of 256 ids; the
answers use 44), under a ChatML
template; it depends on the aux states (zeroing them costs most of its acceptance).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsman.cli import main
from draftsman.doctor import DoctorOptions, diagnose, format_report
from draftsman.doctor.checks import check_d2t, check_layer_ids, engine_captures
from draftsman.doctor.live import pay_table
from draftsman.doctor.probes import clearly_better, matching_probes
from draftsman.doctor.score import Score, histogram_rates, replay_chain
from draftsman.spec.engine import SpecConfig

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = [f"w{i}" for i in range(250)]
AUX = (2, 5, 8)
STEPS = 3  # TTT steps and doctor's chain depth
ANSWER = 16  # tokens per answer
SPEC = SpecConfig.chain(STEPS)


# ---- the pair ------------------------------------------------------------------------------------
def build_target(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    hf = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            strong = 4.0 if i in (1, 4, 7) else 1.0
            for lin, f in ((layer.self_attn.q_proj, 2), (layer.self_attn.k_proj, 2), (layer.self_attn.v_proj, 4),
                           (layer.self_attn.o_proj, 4 * strong), (layer.mlp.gate_proj, 4), (layer.mlp.up_proj, 4),
                           (layer.mlp.down_proj, 4 * strong)):
                lin.weight.mul_(f)
        final = hf.model(torch.randint(6, 256, (64, 24), generator=g)).last_hidden_state.reshape(-1, 64)
        head = hf.lm_head.weight
        for v in torch.linalg.svd(final, full_matrices=False)[2][:3]:
            head -= (head @ v)[:, None] * v[None]
        head.mul_(20)
        hf.model.embed_tokens.weight.mul_(16)  # every layer reads the stream through a norm: same function
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(16)
            layer.mlp.down_proj.weight.mul_(16)
        w = torch.exp(torch.randn(64, generator=torch.Generator().manual_seed(2)) * 3.0)
        hf.model.norm.weight.copy_(w)
        head.div_(w[None])
    hf.save_pretrained(path)
    make_tokenizer(path)
    return path


def make_tokenizer(path: Path, template: str | None = CHATML) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template
    fast.save_pretrained(path)


def random_prompts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist()) for k in lengths]


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> dict[str, Path]:
    """Trained once per session (~20 s on one CPU thread): target, drafter, doctor's prompts."""
    import draftsman
    from draftsman.generate import StopRules, generate_plain
    from draftsman.tokenizer import encode_prompt, load_tokenizer
    from draftsman.train.data import TokenizedConversation
    from draftsman.train.trainer import TrainConfig, train

    root = tmp_path_factory.mktemp("doctor")
    target_dir = build_target(root / "target")
    target, tok = draftsman.load_target(target_dir), load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, t, chat=True) for t in random_prompts(400, seed=0)]
    answers = generate_plain(target, prompts, StopRules(ANSWER, frozenset({2}))).token_ids
    examples = [TokenizedConversation(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers, strict=True)]
    cfg = TrainConfig(target=str(target_dir), out=str(root / "drafter"), ttt_steps=STEPS, batch_size=8,
                      micro_batch_size=8, lr=1e-2, max_steps=300, aux_layers=AUX, draft_vocab_size=32,
                      warmup_ratio=0.05, device="cpu", progress=False)
    train(cfg, examples=examples)
    dataset = root / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in random_prompts(16, seed=1)))
    return {"root": root, "target": target_dir, "drafter": root / "drafter", "dataset": dataset}


def options(pair, **kw) -> DoctorOptions:
    base = dict(dataset=str(pair["dataset"]), num_prompts=16, max_new_tokens=ANSWER, spec=SPEC, batch_sizes=(1, 4),
                device="cpu", timing_steps=3)
    return DoctorOptions(**(base | kw))


def doctor(pair, drafters=None, target=None, **kw) -> dict:
    result = diagnose(str(target or pair["target"]), [str(d) for d in drafters or [pair["drafter"]]], options(pair, **kw))
    print(format_report(result))
    return result


def check(result: dict, name: str) -> dict:
    return next(c for c in result["checks"] if c["name"] == name)


def probe(result: dict, name: str) -> dict:
    return next(p for p in result["probes"] if p["name"] == name)


def plant(pair, name: str, config=None, tensors=None) -> Path:
    """A copy of the healthy drafter with its config.json and/or tensors edited in place."""
    out = shutil.copytree(pair["drafter"], pair["root"] / f"planted-{name}")
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        config(raw)
        (out / "config.json").write_text(json.dumps(raw, indent=2))
    if tensors is not None:
        state = load_file(str(out / "model.safetensors"))
        tensors(state)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def healthy(pair) -> dict:
    return doctor(pair)


# ---- the healthy pair ----------------------------------------------------------------------------
def test_healthy_pair_passes(healthy):
    assert healthy["status"] != "FAIL"
    static = ["hidden sizes", "vocab", "d2t", "t2d", "layer ids", "rope", "max positions", "drafter tensors",
              "tokenizer", "chat template"]
    assert {c["name"]: c["status"] for c in healthy["checks"] if c["name"] in static} == dict.fromkeys(static, "PASS")
    assert "[2, 5, 8]" in check(healthy, "layer ids")["message"]
    exp = healthy["expected"]
    assert check(healthy, "expected acceptance")["status"] == "PASS"
    assert exp["step_accept"][0] > 0.6 and exp["accept_length"] > 2.3
    assert not any(p["clearly_better"] for p in healthy["probes"])
    assert all(c["status"] in ("PASS", "SKIP") for c in healthy["checks"] if c["name"].startswith("convention probe"))
    live = healthy["live"]["engine"]
    assert check(healthy, "live acceptance")["status"] == "PASS" and live["identical"] is True
    # The replayed chain is what the engine does on the same answers: equal up to float rounding.
    assert live["accept_length"] == pytest.approx(exp["accept_length"], abs=0.02)
    assert healthy["verdict"]["kind"] == "healthy"
    pay = healthy["pay"]
    assert [r["batch_size"] for r in pay["rows"]] == [1, 4] and all(r["speedup"] > 0 for r in pay["rows"])
    assert check(healthy, "will it pay")["status"] in ("PASS", "WARN")


def test_engine_fault_probes_on_the_healthy_pair(healthy):
    """The probes for faults an engine makes loading a healthy export (the planted faults of
    benchmarks/vllm_doctor_faults.py): each is scored, and each loses acceptance the
    configuration has, so a live τ this low is explained by them. The pair's RoPE theta is the
    default already, so that probe does not apply."""
    exp = healthy["expected"]["accept_length"]
    for name in ("d2t missing", "d2t shuffled", "norm_before_residual flipped", "norm before fc"):
        p = probe(healthy, name)
        assert p["applicable"] and not p["clearly_better"], name
        assert p["accept_length"] < exp - 0.1, (name, p["accept_length"], exp)
    # a map to the wrong target ids leaves almost nothing to accept
    assert probe(healthy, "d2t shuffled")["accept_length"] < 1.3
    theta = probe(healthy, "default rope theta")
    assert not theta["applicable"] and "theta != 10000" in theta["note"]


# ---- planted faults ------------------------------------------------------------------------------
def test_shifted_layer_ids(pair):
    """eagle_config ids written one too low (converted to 'output of layer i' twice), draftsman
    block removed: SGLang and draftsman now capture [1, 4, 7], vLLM still [2, 5, 8]."""
    def edit(raw):
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 3, 6]
        del raw["draftsman"]

    res = doctor(pair, [plant(pair, "shifted", config=edit)])
    ids = check(res, "layer ids")
    assert ids["status"] == "FAIL" and "engines disagree" in ids["message"]
    assert ids["evidence"]["captures"]["sglang"]["layers"] == [1, 4, 7]
    assert ids["evidence"]["captures"]["vllm"]["layers"] == [2, 5, 8]
    shifted = probe(res, "layer ids +1")
    assert shifted["clearly_better"] and shifted["layer_ids"] == [2, 5, 8]
    assert check(res, "convention probe: layer ids +1")["status"] == "FAIL"
    v = res["verdict"]
    assert v["kind"] == "configuration" and v["causes"][0] == "layer ids +1"
    assert "this drafter was trained with layer ids [2, 5, 8]" in v["message"]
    assert "vLLM captures" in v["message"] and "the configuration uses layer ids [1, 4, 7]" in v["message"]


def test_missing_layer_ids(pair):
    """Every layer-id key removed from a drafter trained on [2, 5, 8]: engines silently use [2, 4, 5]."""
    def edit(raw):
        del raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"], raw["eagle_aux_hidden_state_layer_ids"]
        del raw["draftsman"]

    res = doctor(pair, [plant(pair, "missing", config=edit)])
    ids = check(res, "layer ids")
    assert ids["status"] == "WARN"
    assert "no eagle_aux_hidden_state_layer_ids: engines default to [2, L//2, L-3] = [2, 4, 5]" in ids["message"]
    assert res["drafters"][0]["layer_ids"] == [2, 4, 5]
    search = probe(res, "layer search")
    assert search["clearly_better"] and search["layer_ids"] == [2, 5, 8]
    v = res["verdict"]
    assert v["kind"] == "configuration" and v["causes"][0] == "layer search"
    assert "this drafter was trained with layer ids [2, 5, 8]" in v["message"]
    assert "the configuration uses layer ids [2, 4, 5] (default" in v["message"]


def _draft_ids(state) -> torch.Tensor:
    return torch.arange(state["d2t"].numel()) + state["d2t"]


def test_zeroed_d2t_with_reduced_vocab(pair):
    """d2t zeroed and t2d made to match (the default mapping): no probe can recover the trained
    vocabulary, so the static d2t warning is the cause."""
    def edit(state):
        state["t2d"] = torch.zeros_like(state["t2d"])
        state["t2d"][: state["d2t"].numel()] = True
        state["d2t"] = torch.zeros_like(state["d2t"])

    res = doctor(pair, [plant(pair, "zeroed-d2t", tensors=edit)])
    d2t = check(res, "d2t")
    assert d2t["status"] == "WARN" and "all zeros: the identity mapping" in d2t["message"]
    assert "32 of 256" in d2t["message"]
    assert check(res, "expected acceptance")["status"] == "FAIL"
    v = res["verdict"]
    assert v["kind"] == "checkpoint" and "d2t" in v["causes"] and "d2t: all zeros" in v["message"]


def test_zeroed_d2t_with_t2d_intact(pair):
    """d2t zeroed but t2d still marks the trained vocabulary: t2d fails, and the probe reading
    the vocabulary from t2d recovers the acceptance."""
    res = doctor(pair, [plant(pair, "zeroed-d2t-only", tensors=lambda s: s.update(d2t=torch.zeros_like(s["d2t"])))])
    assert check(res, "d2t")["status"] == "WARN"
    assert check(res, "t2d")["status"] == "FAIL" and "inconsistent with d2t" in check(res, "t2d")["message"]
    assert probe(res, "vocab from t2d")["clearly_better"]
    v = res["verdict"]
    assert v["kind"] == "configuration" and v["causes"][0] == "vocab from t2d"
    assert "trained with the vocabulary t2d marks" in v["message"]


def test_d2t_holding_absolute_ids(pair):
    res = doctor(pair, [plant(pair, "absolute-d2t", tensors=lambda s: s.update(d2t=_draft_ids(s)))])
    d2t = check(res, "d2t")
    assert d2t["status"] == "FAIL" and "looks like it holds absolute target ids" in d2t["message"]
    assert check(res, "live acceptance")["status"] == "SKIP"  # an engine would index out of range
    assert probe(res, "d2t absolute")["clearly_better"]
    v = res["verdict"]
    assert v["kind"] == "configuration" and v["causes"][0] == "d2t absolute"
    assert "trained with d2t holding absolute target ids" in v["message"]


def test_post_norm_hidden_states_is_an_integration_fault(pair):
    """The engine hands the drafter the last aux state after the final norm: the drafter is fine
    (expected high), live acceptance collapses, and the post-norm probe is the one that predicts
    the live number."""
    res = doctor(pair, simulate="post-norm last aux")
    assert check(res, "expected acceptance")["status"] == "PASS"
    live = check(res, "live acceptance")
    assert live["status"] == "FAIL" and "simulating: post-norm last aux" in live["message"]
    v = res["verdict"]
    assert v["kind"] == "integration" and v["causes"][0] == "post-norm last aux"
    assert "likely cause: the engine passes the last aux hidden state after the target's final norm" in v["message"]
    assert res["live"]["engine"]["accept_length"] == pytest.approx(probe(res, "post-norm last aux")["accept_length"],
                                                                   abs=0.02)


def test_dropped_rope_scaling(pair):
    """The drafter config loses rope_scaling while the target uses linear x4 scaling. The static
    check names it. Not visible in acceptance on this pair: the tiny drafter predicts from the aux
    states of its own position and hardly uses positional attention (the 'positions +1' probe is
    flat too), so the 'target rope' probe scores the same as the configuration (measured τ 2.83
    vs 2.82); the verdict keeps the rope failure as its caveat."""
    res = doctor(pair, [plant(pair, "no-rope-scaling", config=lambda raw: raw.update(rope_scaling=None))])
    rope = check(res, "rope")
    assert rope["status"] == "FAIL" and res["status"] == "FAIL"
    assert "drafter: default RoPE" in rope["message"] and "target: linear rope_scaling factor 4" in rope["message"]
    assert "rope_scaling dropped" in rope["message"]
    tr = probe(res, "target rope")
    assert tr["applicable"] and not tr["clearly_better"]
    assert "rope" in res["verdict"]["causes"] and "rope_scaling dropped" in res["verdict"]["message"]


def test_raw_prompts_without_template(pair):
    """The target's tokenizer lost its chat template: prompts reach the model raw, and the drafter
    (trained on templated conversations) cannot predict the answers."""
    target = shutil.copytree(pair["target"], pair["root"] / "target-no-template")
    (target / "chat_template.jinja").unlink(missing_ok=True)
    make_tokenizer(target, template=None)
    res = doctor(pair, target=target)
    tmpl = check(res, "chat template")
    assert tmpl["status"] == "WARN" and "no chat template" in tmpl["message"]
    assert res["chat_template"] is False
    assert check(res, "expected acceptance")["status"] == "FAIL"
    v = res["verdict"]
    assert v["kind"] == "checkpoint" and v["causes"] == ["chat template"]


def test_raw_prompts_at_the_engine_is_an_integration_fault(pair):
    res = doctor(pair, simulate="no chat template")
    v = res["verdict"]
    assert check(res, "live acceptance")["status"] == "FAIL"
    assert v["kind"] == "integration" and v["causes"][0] == "no chat template"
    assert "prompts reach the model without the chat template" in v["message"]


# ---- against a server ----------------------------------------------------------------------------
def test_server_measured_like_the_engine_and_a_broken_server_blamed(pair):
    """`draftsman serve` of the healthy pair gets the engine's τ on the same prompts; a server whose
    target hands the drafter post-norm states is an integration problem the post-norm probe names."""
    from test_serve import LiveServer

    from draftsman.doctor.live import PostNormTarget
    from draftsman.models import load_target
    from draftsman.models.eagle3 import load_drafter
    from draftsman.serve import build_state
    from draftsman.tokenizer import load_tokenizer

    model, tok = load_target(pair["target"]), load_tokenizer(pair["target"])
    drafter = load_drafter(pair["drafter"], target=model)
    results = {}
    for name, served in (("healthy", model), ("post-norm", PostNormTarget(model))):
        state = build_state(served, tok, frozenset({2}), drafter, SPEC, max_model_len=128, max_batch_size=16,
                            model_name=name)
        with LiveServer(state) as server:
            results[name] = doctor(pair, server_url=server.url, batch_sizes=())
    ok, bad = results["healthy"], results["post-norm"]
    srv, eng = ok["live"]["server"], ok["live"]["engine"]
    assert srv["acceptance_source"] == "response" and srv["model"] == "healthy"
    assert srv["accept_length"] == pytest.approx(eng["accept_length"], abs=0.02)
    assert srv["text_equal_chat"] == 16
    assert check(ok, "live acceptance (server)")["status"] == "PASS" and ok["verdict"]["kind"] == "healthy"
    assert check(bad, "live acceptance")["status"] == "PASS"  # draftsman's own engine is fine
    assert check(bad, "live acceptance (server)")["status"] == "FAIL"
    v = bad["verdict"]
    assert v["kind"] == "integration" and "the server" in v["message"] and v["causes"][0] == "post-norm last aux"


# ---- CLI, JSON, comparison -----------------------------------------------------------------------
def run_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


TOP_KEYS = {"target", "drafter", "drafters_compared", "dataset", "num_prompts", "max_new_tokens", "chat_template",
            "spec", "batch_sizes", "device", "dtype", "server_url", "simulate", "target_layers", "status", "checks",
            "expected", "probes", "live", "verdict", "pay", "drafters", "notes"}
PROBE_KEYS = {"name", "applicable", "accept_length", "step0_accept", "delta", "step_accept",
              "accept_rate_per_position", "clearly_better", "trained_with", "configured", "layer_ids", "note"}


def test_cli_json_exit_status_and_two_drafters_side_by_side(pair):
    def edit(raw):
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 3, 6]
        del raw["draftsman"]

    shifted = plant(pair, "cli-shifted", config=edit)
    common = ["--target", str(pair["target"]), "--dataset", str(pair["dataset"]), "--num-prompts", "16",
              "--max-new-tokens", str(ANSWER), "--spec-steps", str(STEPS), "--batch-sizes", "1", "--timing-steps", "2",
              "--device", "cpu", "--json"]
    rc, out = run_cli("doctor", "--drafter", str(pair["drafter"]), *common)
    assert rc == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == TOP_KEYS and result["status"] in ("PASS", "WARN")
    assert all(set(c) == {"name", "status", "message", "evidence"} for c in result["checks"])
    assert {"accept_rate_per_position", "accept_length", "step_accept", "chain", "tree"} <= set(result["expected"])
    assert all(set(p) == PROBE_KEYS for p in result["probes"])
    assert set(result["live"]) == {"engine", "server"} and result["live"]["server"] is None
    assert set(result["verdict"]) == {"kind", "message", "causes"}
    assert set(result["pay"]) == {"accept_length", "accept_length_source", "rows", "loses_from_batch_size",
                                  "pays_up_to_batch_size"}
    assert "overall: " in out and "PASS  expected acceptance" in out

    rc, out = run_cli("doctor", "--drafter", str(pair["drafter"]), "--drafter", str(shifted), *common)
    assert rc == 1  # the shifted drafter FAILs its layer ids
    both = json.loads(out.strip().splitlines()[-1])
    assert [d["verdict"]["kind"] for d in both["drafters"]] == ["healthy", "configuration"]
    assert both["checks"] == both["drafters"][0]["checks"] and both["status"] == "FAIL"
    assert both["drafters"][1]["expected"]["accept_length"] < both["drafters"][0]["expected"]["accept_length"]
    assert "expected τ" in out and "#2 = " in out  # the side-by-side table
    rc, _ = run_cli("doctor", "--drafter", str(shifted), "--exit-zero", *common)
    assert rc == 0


def test_cli_refuses_bad_arguments(pair, capsys):
    rc, _ = run_cli("doctor", "--target", str(pair["target"]), "--drafter", str(pair["drafter"]),
                    "--batch-sizes", "1,x", "--device", "cpu")
    assert rc == 2 and "--batch-sizes" in capsys.readouterr().err


# ---- pure pieces ---------------------------------------------------------------------------------
def test_replay_matches_round_semantics():
    # prompt of 3 tokens, 6 answer tokens; run[t] = leading hits at index t
    run = [0, 0, 2, 0, 1, 0, 0, 0, 0, 0]
    # round at n-1 = 2 accepts 2 (emitted 1 + 3), at 5 accepts 0 (5), at 6 accepts 0 (6 = done)
    assert replay_chain(run, 3, 6, steps=3) == [2, 0, 0]
    # capped at the depth; the last round accepts past the budget, as an engine's does (1 + 4 + 4 >= 6)
    assert replay_chain([5] * 10, 3, 6, steps=3) == [3, 3]
    rates, tau = histogram_rates([2, 0, 0], 3)
    assert rates == pytest.approx([1 / 3, 1 / 3, 0.0]) and tau == pytest.approx(1 + 2 / 3)


def test_engine_captures_and_layer_id_checks():
    from draftsman.config import parse_drafter_config

    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "vocab_size": 256}

    def status(extra: dict) -> tuple[str, dict]:
        raw = base | extra
        c = check_layer_ids(raw, parse_drafter_config(raw), 8, (2, 4, 5))
        return c.status, {k: v["layers"] for k, v in c.evidence["captures"].items()}

    # SpecForge: "output of layer i" ids in eagle_config only; SGLang adds 1, vLLM defaults: same layers
    assert status({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}) == (
        "PASS", {"sglang": [2, 4, 5], "vllm": [2, 4, 5], "draftsman": [2, 4, 5]})
    assert status({})[0] == "WARN"
    s, caps = status({"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})  # vLLM-style only: SGLang defaults
    assert s == "FAIL" and caps["vllm"] == [1, 3, 6] and caps["sglang"] == [2, 4, 5]
    assert status({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]})[0] == "FAIL"  # out of range
    raw = base | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 0, 2]}}
    assert engine_captures(raw, parse_drafter_config(raw), 8, (2, 4, 5))["sglang"]["layers"] == [1, 3, 6]


def test_d2t_checks():
    assert check_d2t(None, 256, 256).status == "PASS"
    assert check_d2t(None, 256, 32).status == "FAIL"
    assert check_d2t(torch.zeros(32, dtype=torch.long), 256, 32).status == "WARN"
    assert check_d2t(torch.zeros(256, dtype=torch.long), 256, 256).status == "PASS"  # identity, full vocab
    ids = torch.arange(0, 256, 8)
    assert check_d2t(ids - torch.arange(32), 256, 32).status == "PASS"
    absolute = check_d2t(ids, 256, 32)
    assert absolute.status == "FAIL" and absolute.evidence["looks_absolute"]


def _score(step0: float, tau: float) -> Score:
    return Score([step0], [step0], [tau - 1], tau, 10, 10)


def test_clearly_better_needs_absolute_and_relative_margins():
    assert clearly_better(_score(0.5, 1.5), _score(0.2, 1.2))
    assert not clearly_better(_score(0.35, 1.35), _score(0.3, 1.3))  # +0.05: too small
    assert not clearly_better(_score(0.85, 2.0), _score(0.7, 1.8))  # 1.2x: not relative enough
    assert clearly_better(_score(0.8, 2.9), _score(0.8, 1.9))  # later positions: τ - 1 doubles


def test_pay_table_finds_where_speculation_stops_paying():
    costs = {1: {"plain_step_s": 0.010, "spec_round_s": 0.012}, 16: {"plain_step_s": 0.011, "spec_round_s": 0.020},
             64: {"plain_step_s": 0.020, "spec_round_s": 0.060}}
    pay = pay_table(costs, accept_length=2.5)
    assert [r["speedup"] for r in pay["rows"]] == pytest.approx([2.5 * 10 / 12, 2.5 * 11 / 20, 2.5 * 20 / 60], abs=1e-3)
    assert pay["pays_up_to_batch_size"] == 16 and pay["loses_from_batch_size"] == 64


def test_matching_probes_rank_by_closeness():
    from draftsman.doctor.probes import Probe

    def p(name: str, tau: float) -> Probe:
        out = Probe(name, None, "", "", "")
        out.score = _score(tau - 1, tau)
        return out

    probes = [p("a", 1.3), p("b", 1.05), p("c", 2.4)]
    got = matching_probes({"accept_length": 1.1, "accept_rate_per_position": [0.1]}, probes, _score(0.8, 2.5))
    assert [q.name for q, _ in got] == ["b"]  # within max(0.1, 0.25 x 0.1) of 1.1; c shows no drop


def test_same_answers_make_a_small_server_gap_an_integration_fault():
    """A server that wrote the replay's very answers must match its τ up to rounding: a 4% drop is
    then real, and the probe reproducing it to EXACT_TOL is named, even for a weak drafter (its
    low expected acceptance becomes a caveat, not the verdict)."""
    from draftsman.doctor.probes import Probe
    from draftsman.doctor.verdict import verdict

    def p(name: str, tau: float) -> Probe:
        out = Probe(name, None, "", "", f"fault {name}")
        out.score = _score(tau - 1, tau)
        return out

    expected = _score(0.35, 1.57)  # step-0 below EXPECT_WARN: alone, a "training" verdict
    probes = [p("layer ids +1", 1.51), p("layer ids -1", 1.45), p("d2t missing", 1.0)]
    live = {"accept_length": 1.57, "accept_rate_per_position": [0.35]}
    server = {"accept_length": 1.509, "accept_rate_per_position": [0.31], "texts_total": 8, "text_equal_chat": 8}
    v = verdict([], expected, probes, live, server)
    assert v["kind"] == "integration" and v["causes"] == ["layer ids +1"]
    assert "likely cause: fault layer ids +1" in v["message"] and "besides, training/data problem" in v["message"]
    # different answers: the replay is no exact prediction, so a 4% drop proves nothing
    assert verdict([], expected, probes, live, server | {"text_equal_chat": 6})["kind"] == "training"
    # the same answers and the same τ: no integration fault
    same = verdict([], expected, probes, live, server | {"accept_length": 1.568})
    assert same["kind"] == "training" and "the integration is healthy: the server gets τ 1.57" in same["message"]
