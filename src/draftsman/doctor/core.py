"""`diagnose`: static checks, expected acceptance, convention probes, live acceptance, step costs
and a verdict, for one target and one or more drafters on the same prompts."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsman.doctor.checks import (
    FAIL,
    PASS,
    SKIP,
    Check,
    check_chat_template,
    check_d2t,
    check_hidden_sizes,
    check_layer_ids,
    check_max_positions,
    check_rope,
    check_t2d,
    check_tokenizer,
    check_vocab,
    engine_captures,
    mapped_ids,
    short_source,
    worst,
)
from draftsman.doctor.live import live_in_process, live_server, pay_table, step_costs
from draftsman.doctor.load import LoadedDrafter, load_lenient
from draftsman.doctor.probes import (
    Probe,
    expected_check,
    integration_probes,
    layer_probes,
    other_probes,
    probe_check,
    probe_json,
)
from draftsman.doctor.score import (
    Convention,
    Features,
    Sample,
    Score,
    capture_features,
    feature_bytes,
    layer_search,
    score,
)
from draftsman.doctor.verdict import live_check, pay_check, server_check, verdict
from draftsman.spec.engine import SpecConfig


class DoctorError(RuntimeError):
    """doctor cannot run at all (the target does not load, the prompts do not fit)."""


@dataclass
class DoctorOptions:
    dataset: str = "mt-bench"
    num_prompts: int = 16
    max_new_tokens: int = 128
    spec: SpecConfig = field(default_factory=lambda: SpecConfig.chain(3))
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    device: str = "auto"
    dtype: str = "auto"
    server_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 4
    simulate: str | None = None  # an integration fault for the in-process live engine (live.SIMULATIONS)
    layer_search: bool = True
    timing_steps: int = 8
    feature_budget_bytes: int = 4 << 30  # all-layer capture for the layer search only below this


@dataclass
class Data:
    """The prompts and the target's greedy answers, with and without the chat template."""

    texts: list[str]
    chat: bool  # the chat template was applied to `samples`
    samples: list[Sample]
    raw: list[Sample] | None = None  # raw prompts (when `samples` are templated)
    eos: frozenset[int] = frozenset()  # the stop ids the answers were written with


def _log(progress: Callable[[str], None] | None, text: str) -> None:
    if progress is not None:
        progress(text)


# ---- data ---------------------------------------------------------------------------------------
def prepare_data(target, target_dir: str, tokenizer, texts: list[str], opts: DoctorOptions) -> Data:
    """Greedy target answers to the prompts (templated when the target has a chat template), and
    to the raw prompts for the chat-template probe."""
    from draftsman.generate import StopRules, generate_plain
    from draftsman.tokenizer import encode_prompt, eos_token_ids

    chat = bool(getattr(tokenizer, "chat_template", None))
    eos = frozenset(eos_token_ids(target_dir, target.config.eos_token_ids, tokenizer))
    # Past the budget and past EOS: an engine's last round verifies drafts beyond its stop.
    lookahead = opts.spec.steps
    rules = StopRules(opts.max_new_tokens + lookahead)

    def emitted(answer: list[int]) -> int:
        stop = next((i + 1 for i, t in enumerate(answer[: opts.max_new_tokens]) if t in eos), None)
        return stop or min(len(answer), opts.max_new_tokens)

    def answer(prompts: list[list[int]]) -> list[Sample]:
        longest, window = max(len(p) for p in prompts), target.config.max_position_embeddings
        if longest + opts.max_new_tokens > window:
            raise DoctorError(f"the longest prompt ({longest} tokens) + --max-new-tokens {opts.max_new_tokens} "
                              f"exceeds the target's max_position_embeddings={window}")
        with torch.no_grad():
            out = generate_plain(target, prompts, StopRules(min(rules.max_new_tokens, window - longest)))
        return [Sample(list(p), list(a), emitted(a)) for p, a in zip(prompts, out.token_ids, strict=True)]

    samples = answer([encode_prompt(tokenizer, t, chat=chat) for t in texts])
    raw = answer([encode_prompt(tokenizer, t, chat=False) for t in texts]) if chat else None
    return Data(texts, chat, samples, raw, eos)


def needed_layers(loaded: Sequence[LoadedDrafter], n_layers: int, search: bool) -> list[int]:
    if search:
        return list(range(n_layers + 1))
    ids: set[int] = set()
    for ld in loaded:
        if ld.drafter is None:
            continue
        base = tuple(ld.drafter.aux_layer_ids)
        for shift in (-1, 0, 1):
            ids |= {i + shift for i in base}
        for c in engine_captures(ld.raw_config, ld.config, n_layers, base).values():
            ids |= set(c["layers"])
        ids |= {2, n_layers // 2, n_layers - 3}
    return sorted(i for i in ids if 0 <= i <= n_layers)


# ---- one drafter ----------------------------------------------------------------------------------
def static_checks(ld: LoadedDrafter, target, tokenizer, target_dir: str) -> list[Check]:
    tcfg = target.config
    checks: list[Check] = []
    if ld.config is None:
        checks.append(Check("drafter config", FAIL, "; ".join(ld.errors), {}))
    else:
        cfg = ld.config
        default = tuple(tcfg.default_aux_layer_ids())
        checks += [
            check_hidden_sizes(cfg, tcfg, ld.fc_in, ld.own_embedding),
            check_vocab(cfg, tcfg, ld.lm_head_rows, None if tokenizer is None else len(tokenizer)),
            check_d2t(ld.d2t, cfg.vocab_size, cfg.draft_vocab_size),
            check_t2d(ld.t2d, ld.d2t, cfg.vocab_size, cfg.draft_vocab_size),
            check_layer_ids(ld.raw_config, cfg, tcfg.num_hidden_layers, default),
            check_rope(cfg.rope, tcfg.rope),
            check_max_positions(cfg.max_position_embeddings, tcfg.max_position_embeddings),
        ]
        if ld.errors:
            checks.append(Check("drafter tensors", FAIL, "; ".join(ld.errors), {"notes": ld.notes}))
        else:
            checks.append(Check("drafter tensors", PASS, "every tensor present and shaped as config.json implies"
                                + (f" ({'; '.join(ld.notes)})" if ld.notes else ""), {"notes": ld.notes}))
    checks += [check_tokenizer(tokenizer, target_dir), check_chat_template(tokenizer)]
    return checks


def _scorable(conv: Convention, feats: Features | None) -> bool:
    return feats is not None and len(conv.layer_ids) == 3 and all(i in feats.states for i in conv.layer_ids)


def run_probes(ld: LoadedDrafter, target, configured: Convention, feats: Features, raw: Features | None,
               opts: DoctorOptions) -> list[Probe]:
    d, tcfg = ld.drafter, target.config
    n = tcfg.num_hidden_layers
    captures = engine_captures(ld.raw_config, ld.config, n, configured.layer_ids)
    probes = layer_probes(configured, d.layer_ids_source, n, captures)
    probes += other_probes(configured, ld.d2t, ld.t2d, tcfg.vocab_size, ld.config.rope, tcfg.rope, raw is not None,
                           opts.spec.steps)
    probes += integration_probes(configured, ld.d2t, ld.config.rope, ld.config.norm_before_residual)
    for p in probes:
        if p.convention is None:
            continue
        data = raw if p.convention.data == "raw" else feats
        if not _scorable(p.convention, data):
            p.note = f"layers {list(p.convention.layer_ids)} were not captured"
            continue
        p.score = score(d, target, data, p.convention, opts.spec.steps, opts.spec.topk)
    if opts.layer_search and all(i in feats.states for i in range(n + 1)):
        starts = [configured.layer_ids] + [p.layer_ids for p in probes if p.layer_ids]
        best, _, evals = layer_search(d, target, feats, configured, starts, n)
        conv = dataclasses.replace(configured, layer_ids=best)
        probe = Probe("layer search", conv, f"layer ids {list(best)} (the best step-0 acceptance over the target's "
                      f"layers, {evals} combinations tried)", f"layer ids {list(configured.layer_ids)} "
                      f"({short_source(d.layer_ids_source)})", f"the engine captures layers other than {list(best)}",
                      note=None if best != configured.layer_ids else "the configured ids score best", layer_ids=best)
        probe.score = score(d, target, feats, conv, opts.spec.steps, opts.spec.topk)
        probes.append(probe)
    return probes


@dataclass
class DrafterRun:
    """What one drafter's diagnosis has gathered so far."""

    ld: LoadedDrafter
    checks: list[Check]
    expected: Score | None = None
    probes: list[Probe] = field(default_factory=list)
    live: dict[str, Any] | None = None
    server: dict[str, Any] | None = None
    pay: dict[str, Any] | None = None

    def cannot_run(self, data: Data | None) -> str:
        if data is None:
            return "no prompts (no tokenizer)"
        why = self.ld.errors + self.ld.notes
        return "the engine cannot run this drafter" + (f": {'; '.join(why)}" if why else "")


def expected_phase(run: DrafterRun, target, data: Data | None, feats: Features | None, raw_feats: Features | None,
                   opts: DoctorOptions, progress: Callable[[str], None] | None) -> None:
    d = run.ld.drafter
    if d is None or feats is None:
        why = "no prompts could be encoded (no tokenizer)" if feats is None else \
            "the drafter cannot be built: " + "; ".join(run.ld.errors)
        run.checks.append(Check("expected acceptance", SKIP, why, {}))
        return
    configured = Convention(tuple(d.aux_layer_ids), mapped_ids(d.d2t))
    if not _scorable(configured, feats):
        run.checks.append(Check("expected acceptance", SKIP, f"layer ids {list(configured.layer_ids)} cannot be "
                                "captured from this target", {}))
        return
    _log(progress, f"scoring {run.ld.path} teacher-forced on the target's answers")
    run.expected = score(d, target, feats, configured, opts.spec.steps, opts.spec.topk)
    run.checks.append(expected_check(run.expected, opts.spec.steps))
    _log(progress, "convention probes")
    run.probes = run_probes(run.ld, target, configured, feats, raw_feats, opts)
    run.checks += [probe_check(p, run.expected) for p in run.probes]


def live_phase(run: DrafterRun, index: int, target, tokenizer, data: Data | None, opts: DoctorOptions,
               progress: Callable[[str], None] | None) -> None:
    if run.ld.bound and data is not None:
        _log(progress, "live acceptance (draftsman engine)")
        run.live = run_live(run.ld.drafter, target, data, opts)
        run.checks.append(live_check(run.live, run.expected, "live acceptance"))
    else:
        run.checks.append(Check("live acceptance", SKIP, run.cannot_run(data), {}))
    if opts.server_url and index == 0 and data is not None:  # the server serves the first drafter
        _log(progress, f"live acceptance ({opts.server_url})")
        server, notes = live_server(opts.server_url, opts.model, opts.api_key, data.texts, opts.max_new_tokens,
                                    opts.concurrency, chat=data.chat)
        server["notes"] = notes
        server_text_match(server, data, tokenizer)
        reference = run.live if run.live is not None and not opts.simulate else None
        run.server = server
        run.checks.append(server_check(server, run.expected, reference, opts.spec))


def pay_phase(run: DrafterRun, target, data: Data | None, opts: DoctorOptions,
              progress: Callable[[str], None] | None) -> None:
    if not opts.batch_sizes:
        run.checks.append(Check("will it pay", SKIP, "no --batch-sizes to time", {}))
        return
    if not run.ld.bound or data is None:
        run.checks.append(Check("will it pay", SKIP, run.cannot_run(data), {}))
        return
    _log(progress, f"step costs at batch sizes {list(opts.batch_sizes)}")
    if run.live is not None:  # what the engine delivers, else what it should
        tau, source = run.live["accept_length"], "live"
    else:
        tau, source = (run.expected.accept_length, "expected") if run.expected is not None else (1.0, "none")
    prompts = [s.prompt for s in data.samples]
    costs = {bs: step_costs(target, run.ld.drafter, opts.spec, prompts, bs, opts.timing_steps)
             for bs in opts.batch_sizes}
    run.pay = pay_table(costs, tau) | {"accept_length_source": source}
    run.checks.append(pay_check(run.pay))


def diagnose_drafter(index: int, ld: LoadedDrafter, target, tokenizer, target_dir: str, data: Data | None,
                     feats: Features | None, raw_feats: Features | None, opts: DoctorOptions,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    run = DrafterRun(ld, static_checks(ld, target, tokenizer, target_dir))
    expected_phase(run, target, data, feats, raw_feats, opts, progress)
    live_phase(run, index, target, tokenizer, data, opts, progress)
    pay_phase(run, target, data, opts, progress)
    return {
        "drafter": ld.path,
        "status": worst([c.status for c in run.checks]),
        "layer_ids": None if ld.drafter is None else list(ld.drafter.aux_layer_ids),
        "checks": [c.to_json() for c in run.checks],
        "expected": None if run.expected is None else expected_json(run.expected, data),
        "probes": [probe_json(p, run.expected) for p in run.probes],
        "live": {"engine": run.live, "server": _public_server(run.server)},
        "verdict": verdict(run.checks, run.expected, run.probes, run.live, run.server, bool(opts.simulate)),
        "pay": run.pay,
    }


def expected_json(s, data: Data | None) -> dict[str, Any]:
    out = s.to_json()
    out["chat_template"] = None if data is None else data.chat
    return out


# ---- live -----------------------------------------------------------------------------------------
def run_live(drafter, target, data: Data, opts: DoctorOptions) -> dict[str, Any]:
    from draftsman.generate import StopRules

    samples = data.raw if opts.simulate == "no chat template" and data.raw is not None else data.samples
    rules = StopRules(opts.max_new_tokens, data.eos)  # the rules the answers were written with
    return live_in_process(target, drafter, opts.spec, [s.prompt for s in samples], rules,
                           [s.emitted for s in samples], opts.simulate)


def server_text_match(server: dict, data: Data, tokenizer) -> None:
    """How many served answers equal the target's greedy answers with / without the template: a
    server that matches the raw answers is not applying the chat template."""
    texts = [(t or "").strip() for t in server.get("texts") or []]
    if not texts or tokenizer is None:
        return

    def count(samples: list[Sample] | None) -> int | None:
        if samples is None:
            return None
        ours = [tokenizer.decode(s.emitted, skip_special_tokens=True).strip() for s in samples]
        return sum(a == b for a, b in zip(texts, ours, strict=False))

    chat, raw = count(data.samples), count(data.raw)
    server["text_equal_chat"], server["text_equal_raw"] = chat, raw
    server["texts_total"] = len(texts)
    parts = [f"server text equals the in-process greedy answer for {chat}/{len(texts)} prompts"]
    if raw is not None and raw > (chat or 0):
        parts.append(f"but the RAW-prompt answer for {raw}/{len(texts)}: the server does not apply the chat template")
    server["text_matches"] = ", ".join(parts)


def _public_server(server: dict | None) -> dict | None:
    return None if server is None else {k: v for k, v in server.items() if k != "texts"}


# ---- all drafters -------------------------------------------------------------------------------
def gather(target, target_dir: str, tokenizer, loaded: Sequence[LoadedDrafter], opts: DoctorOptions,
           notes: list[str], progress: Callable[[str], None] | None
           ) -> tuple[Data | None, Features | None, Features | None, DoctorOptions]:
    """The target's answers and the hidden states every drafter's scoring needs (captured once):
    all layers for the layer search when they fit in the budget, else the probed ones."""
    from draftsman.bench import load_prompt_set

    if tokenizer is None:
        return None, None, None, opts
    texts = load_prompt_set(opts.dataset, opts.num_prompts)
    _log(progress, f"the target answers {len(texts)} prompts (greedy, up to {opts.max_new_tokens} tokens)")
    data = prepare_data(target, target_dir, tokenizer, texts, opts)
    if not data.chat:
        notes.append("the target has no chat template: prompts are scored raw")
    n_layers = target.config.num_hidden_layers
    per_layer = feature_bytes(data.samples, target.config.hidden_size, target.embed_tokens.weight.element_size())
    if opts.layer_search and per_layer * (n_layers + 1) > opts.feature_budget_bytes:
        opts = dataclasses.replace(opts, layer_search=False)
        notes.append(f"layer search skipped: capturing all {n_layers + 1} layers would take "
                     f"{per_layer * (n_layers + 1) / 2**30:.1f} GiB")
    _log(progress, "capturing the target's hidden states")
    feats = capture_features(target, data.samples, needed_layers(loaded, n_layers, opts.layer_search))
    raw_feats = None
    if data.raw is not None:  # the chat-template probe reads the configured layers only
        configured = {i for ld in loaded if ld.drafter is not None for i in ld.drafter.aux_layer_ids}
        raw_feats = capture_features(target, data.raw, sorted(i for i in configured if 0 <= i <= n_layers))
    return data, feats, raw_feats, opts


def diagnose(target_dir: str, drafter_dirs: Sequence[str], opts: DoctorOptions,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (see draftsman.commands.doctor for the keys)."""
    from draftsman.cli import resolve_device, resolve_dtype
    from draftsman.config import ConfigError
    from draftsman.models import load_target
    from draftsman.tokenizer import load_tokenizer
    from draftsman.weights import CheckpointError

    if not drafter_dirs:
        raise DoctorError("give at least one --drafter")
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    try:
        target = load_target(target_dir, device=device, dtype=dtype)
    except (ConfigError, CheckpointError) as e:
        raise DoctorError(f"--target {target_dir}: {e}") from None
    tokenizer = load_tokenizer(target_dir)
    loaded = [load_lenient(p, target, device, dtype) for p in drafter_dirs]
    notes: list[str] = []
    data, feats, raw_feats, opts = gather(target, target_dir, tokenizer, loaded, opts, notes, progress)
    reports = [diagnose_drafter(i, ld, target, tokenizer, target_dir, data, feats, raw_feats, opts, progress)
               for i, ld in enumerate(loaded)]
    spec, first = opts.spec, reports[0]
    return {
        "target": str(target_dir), "drafter": first["drafter"], "drafters_compared": len(reports),
        "dataset": opts.dataset, "num_prompts": 0 if data is None else len(data.texts),
        "max_new_tokens": opts.max_new_tokens, "chat_template": None if data is None else data.chat,
        "spec": {"steps": spec.steps, "topk": spec.topk, "draft_tokens": spec.draft_tokens},
        "batch_sizes": list(opts.batch_sizes), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "server_url": opts.server_url, "simulate": opts.simulate, "target_layers": target.config.num_hidden_layers,
        "status": worst([r["status"] for r in reports]),
        "checks": first["checks"], "expected": first["expected"], "probes": first["probes"], "live": first["live"],
        "verdict": first["verdict"], "pay": first["pay"], "drafters": reports, "notes": notes,
    }


def stderr_progress(text: str) -> None:
    print(f"doctor: {text}", file=sys.stderr, flush=True)
