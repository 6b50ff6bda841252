"""Static checks of a (target, drafter) pair: what can be read from config.json and the drafter's
tensors without running anything. Each check is a pure function returning a `Check`.

Layer ids are compared the way each engine reads them (DESIGN.md, "Auxiliary hidden states"):
  SGLang     eagle_config.eagle_aux_hidden_state_layer_ids + 1, else [2, L//2, L-3]
  vLLM       top-level eagle_aux_hidden_state_layer_ids as given, else [2, L//2, L-3]
  draftsman  the `draftsman` block, else eagle_config (+1), else top-level, else its default
All of them mean "residual stream entering layer i". SGLang and vLLM capture while iterating the
layers, so they concatenate the states in ascending layer order, each layer once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from draftsman.config import DrafterConfig, RopeConfig, TargetConfig

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {SKIP: 0, PASS: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    """One line of the report: what was checked, the outcome, and the numbers behind it."""

    name: str
    status: str  # PASS | WARN | FAIL | SKIP (could not run; says why)
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message, "evidence": self.evidence}


def worst(statuses: Sequence[str]) -> str:
    """The most severe status (FAIL > WARN > PASS; SKIP counts as PASS)."""
    top = max((SEVERITY[s] for s in statuses), default=0)
    return {0: PASS, 1: WARN, 2: FAIL}[top]


# ---- sizes ----------------------------------------------------------------------------------------
def check_hidden_sizes(cfg: DrafterConfig, target: TargetConfig, fc_in: int | None, own_embedding: bool) -> Check:
    """fc must read cat(3 aux states) of the target's width; a drafter without its own embedding
    must be as wide as the target (it reads the target's embedding)."""
    th = target.hidden_size
    ev = {"fc_in_features": fc_in, "target_hidden_size": th, "expected_fc_in_features": 3 * th,
          "drafter_hidden_size": cfg.hidden_size, "drafter_target_hidden_size": cfg.target_hidden_size}
    problems = []
    if fc_in is not None and fc_in != 3 * th:
        problems.append(f"fc.weight reads {fc_in} features, not 3 x target hidden {th} = {3 * th}")
    if cfg.target_hidden_size != th:
        problems.append(f"config target_hidden_size={cfg.target_hidden_size} but the target's hidden_size={th}")
    if not own_embedding and cfg.hidden_size != th:
        problems.append(f"drafter hidden_size={cfg.hidden_size} differs from the target's {th} and the drafter "
                        "has no embed_tokens of its own")
    if problems:
        return Check("hidden sizes", FAIL, "; ".join(problems), ev)
    return Check("hidden sizes", PASS, f"fc reads 3 x {th} = {3 * th} features (the target's hidden size)", ev)


def check_vocab(cfg: DrafterConfig, target: TargetConfig, lm_head_rows: int | None,
                tokenizer_size: int | None) -> Check:
    ev = {"drafter_vocab_size": cfg.vocab_size, "target_vocab_size": target.vocab_size,
          "draft_vocab_size": cfg.draft_vocab_size, "lm_head_rows": lm_head_rows, "tokenizer_size": tokenizer_size}
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"drafter vocab_size={cfg.vocab_size} but the target's vocab_size={target.vocab_size}")
    if lm_head_rows is not None and lm_head_rows != cfg.draft_vocab_size:
        problems.append(f"lm_head has {lm_head_rows} rows but draft_vocab_size={cfg.draft_vocab_size}")
    if problems:
        return Check("vocab", FAIL, "; ".join(problems), ev)
    if tokenizer_size is not None and tokenizer_size > target.vocab_size:
        return Check("vocab", WARN, f"the tokenizer has {tokenizer_size} tokens, more than the target's "
                     f"vocab_size={target.vocab_size}: some ids have no embedding", ev)
    scope = "full vocabulary" if cfg.full_vocab else f"{cfg.draft_vocab_size} of {cfg.vocab_size} ids"
    return Check("vocab", PASS, f"vocab_size {cfg.vocab_size} matches the target; draft vocabulary: {scope}", ev)


# ---- vocabulary mapping -------------------------------------------------------------------------
def mapped_ids(d2t: Tensor) -> Tensor:
    """Target id of each draft row when d2t holds offsets (target_id = draft_id + d2t[draft_id])."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def valid_mapping(ids: Tensor, vocab_size: int) -> bool:
    """Every id inside the target vocabulary and no two rows on the same id."""
    inside = bool(((ids >= 0) & (ids < vocab_size)).all())
    return inside and torch.unique(ids).numel() == ids.numel()


def check_d2t(d2t: Tensor | None, vocab_size: int, draft_vocab_size: int) -> Check:
    """Offsets in range, injective, and not a placeholder (zeros) when the vocabulary is reduced."""
    full = draft_vocab_size == vocab_size
    ev: dict[str, Any] = {"present": d2t is not None, "draft_vocab_size": draft_vocab_size, "vocab_size": vocab_size}
    if d2t is None:
        if full:
            return Check("d2t", PASS, "absent: identity over the full vocabulary (what engines assume)", ev)
        return Check("d2t", FAIL, f"missing: draft_vocab_size={draft_vocab_size} < vocab_size={vocab_size}, so "
                     "engines cannot map draft ids to target ids", ev)
    if d2t.numel() != draft_vocab_size:
        return Check("d2t", FAIL, f"d2t has {d2t.numel()} entries, draft_vocab_size={draft_vocab_size}", ev)
    ids = mapped_ids(d2t)
    outside = int(((ids < 0) | (ids >= vocab_size)).sum())
    dups = ids.numel() - torch.unique(ids).numel()
    zeros = not bool(d2t.any())
    ev |= {"out_of_range": outside, "duplicates": dups, "all_zero": zeros,
           "min_target_id": int(ids.min()), "max_target_id": int(ids.max())}
    if outside or dups:
        msg = (f"as offsets (target_id = draft_id + d2t[draft_id]) d2t maps {outside} draft ids outside 0.."
               f"{vocab_size - 1} and {dups} onto an already-mapped id")
        if valid_mapping(d2t, vocab_size):
            msg += ("; the values themselves are distinct valid ids: d2t looks like it holds absolute target "
                    "ids, but engines read offsets")
            ev["looks_absolute"] = True
        return Check("d2t", FAIL, msg, ev)
    if zeros and not full:
        return Check("d2t", WARN, f"all zeros: the identity mapping (draft id i -> target id i) with a reduced "
                     f"draft vocabulary ({draft_vocab_size} of {vocab_size}); a default or placeholder d2t, "
                     "rarely the trained one (drafters keep the most frequent target tokens)", ev)
    kind = "identity over the full vocabulary" if zeros else f"target ids {int(ids.min())}..{int(ids.max())}"
    return Check("d2t", PASS, f"{draft_vocab_size} offsets, in range and one-to-one ({kind})", ev)


def check_t2d(t2d: Tensor | None, d2t: Tensor | None, vocab_size: int, draft_vocab_size: int) -> Check:
    """t2d must mark exactly the target ids d2t maps to (engines use d2t; training used both)."""
    ev: dict[str, Any] = {"present": t2d is not None}
    if t2d is None:
        return Check("t2d", PASS, "absent: derived from d2t (SGLang and vLLM read only d2t)", ev)
    marked = int(t2d.sum())
    ev |= {"size": t2d.numel(), "marked": marked}
    if t2d.numel() != vocab_size:
        return Check("t2d", FAIL, f"t2d has {t2d.numel()} entries, vocab_size={vocab_size}", ev)
    if d2t is None or d2t.numel() != draft_vocab_size:
        return Check("t2d", SKIP, "no usable d2t to compare with", ev)
    ids = mapped_ids(d2t)
    expected = torch.zeros(vocab_size, dtype=torch.bool)
    expected[ids[(ids >= 0) & (ids < vocab_size)].cpu()] = True
    t2d = t2d.bool().cpu()
    differ = int((expected != t2d).sum())
    ev["ids_differing"] = differ
    if differ:
        return Check("t2d", FAIL, f"inconsistent with d2t: t2d marks {marked} ids, d2t maps to a set that differs "
                     f"in {differ} ids; one of them was edited, zeroed or rebuilt (engines follow d2t)", ev)
    return Check("t2d", PASS, f"marks exactly the {marked} target ids d2t maps to", ev)


# ---- layer ids ----------------------------------------------------------------------------------
def engine_default(n_layers: int) -> tuple[int, int, int]:
    """What SGLang and vLLM capture without ids: [2, L//2, L-3] (input of layer i)."""
    return (2, n_layers // 2, n_layers - 3)


def short_source(source: str) -> str:
    """A layer-id source without the config path draftsman's parser prefixes it with."""
    return source.split("config.json: ", 1)[-1]


def _ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list | tuple) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return tuple(value)
    return None


def engine_captures(raw: dict[str, Any], cfg: DrafterConfig | None, n_layers: int,
                    draftsman_default: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per engine: the target layers whose input it concatenates for fc, in fc's order, and why."""
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    nested, top = _ids(eagle.get("eagle_aux_hidden_state_layer_ids")), _ids(raw.get("eagle_aux_hidden_state_layer_ids"))
    default = engine_default(n_layers)

    def layer_order(ids: Sequence[int]) -> list[int]:  # captured while iterating the layers
        return sorted(set(ids))

    out: dict[str, dict[str, Any]] = {}
    if nested is not None:
        out["sglang"] = {"layers": layer_order(i + 1 for i in nested),
                         "source": f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} + 1"}
    else:
        out["sglang"] = {"layers": layer_order(default), "source": "default [2, L//2, L-3]"}
    if top is not None:
        out["vllm"] = {"layers": layer_order(top), "source": f"eagle_aux_hidden_state_layer_ids={list(top)} as given"}
    else:
        out["vllm"] = {"layers": layer_order(default), "source": "default [2, L//2, L-3]"}
    if cfg is not None and cfg.aux_layer_ids is not None:
        out["draftsman"] = {"layers": list(cfg.aux_layer_ids), "source": short_source(cfg.layer_ids_source)}
    else:
        out["draftsman"] = {"layers": list(draftsman_default), "source": "default from the target"}
    return out


def check_layer_ids(raw: dict[str, Any], cfg: DrafterConfig | None, n_layers: int,
                    draftsman_default: Sequence[int]) -> Check:
    """Layer ids present, in range, and captured identically by SGLang, vLLM and draftsman."""
    captures = engine_captures(raw, cfg, n_layers, draftsman_default)
    ev: dict[str, Any] = {"num_target_layers": n_layers, "captures": captures}
    given = cfg is not None and cfg.aux_layer_ids is not None
    bad = {name: [i for i in c["layers"] if not 0 <= i <= n_layers] for name, c in captures.items()}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        where = "; ".join(f"{k} would capture layers {captures[k]['layers']} ({captures[k]['source']})" for k in bad)
        return Check("layer ids", FAIL, f"out of range for a {n_layers}-layer target (valid 0..{n_layers}): {where}", ev)
    short = [k for k, c in captures.items() if len(c["layers"]) != 3]
    if not given:
        msg = (f"no eagle_aux_hidden_state_layer_ids: engines default to [2, L//2, L-3] = "
               f"{list(engine_default(n_layers))}; right only if the drafter was trained on those layers")
        if short:
            msg += f"; duplicate ids: {', '.join(short)} would capture only {len(captures[short[0]]['layers'])} states"
        return Check("layer ids", WARN, msg, ev)
    layers = {k: c["layers"] for k, c in captures.items()}
    if len({tuple(v) for v in layers.values()}) > 1:
        desc = "; ".join(f"{k} captures the input of layers {c['layers']} ({c['source']})" for k, c in captures.items())
        return Check("layer ids", FAIL, f"engines disagree (the +1 convention split): {desc}", ev)
    if short:
        return Check("layer ids", FAIL, f"duplicate layer ids {layers['draftsman']}: engines capture each layer once, "
                     "so fc would get fewer than 3 states", ev)
    return Check("layer ids", PASS, f"SGLang, vLLM and draftsman all capture the input of layers "
                 f"{layers['draftsman']} ({captures['draftsman']['source']})", ev)


# ---- positions ----------------------------------------------------------------------------------
def describe_rope(rope: RopeConfig) -> str:
    if rope.type == "default":
        return f"default RoPE (theta {rope.theta:g}, no rope_scaling)"
    return f"{rope.type} rope_scaling factor {rope.factor:g} (theta {rope.theta:g})"


def rope_differences(drafter: RopeConfig, target: RopeConfig) -> list[str]:
    """Fields where the two RoPE settings rotate positions differently."""
    keys = ["theta", "type", "factor"]
    if "default" not in (drafter.type, target.type):
        keys += ["original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"]
    return [k for k in keys if getattr(drafter, k) != getattr(target, k)]


def check_rope(drafter: RopeConfig, target: RopeConfig) -> Check:
    ev = {"drafter": drafter.to_hf() | {"rope_theta": drafter.theta}, "target": target.to_hf() | {"rope_theta": target.theta}}
    diff = rope_differences(drafter, target)
    if not diff:
        return Check("rope", PASS, f"drafter and target agree: {describe_rope(target)}", ev)
    ev["differs_in"] = diff
    msg = f"drafter: {describe_rope(drafter)}; target: {describe_rope(target)}"
    if drafter.type == "default" and target.type != "default":
        msg += " -- rope_scaling dropped from the drafter config?"
    return Check("rope", FAIL, msg, ev)


def check_max_positions(drafter_max: int, target_max: int) -> Check:
    ev = {"drafter": drafter_max, "target": target_max}
    if drafter_max < target_max:
        return Check("max positions", WARN, f"drafter max_position_embeddings={drafter_max} < the target's "
                     f"{target_max}: engines may cap the context at the drafter's limit", ev)
    return Check("max positions", PASS, f"drafter {drafter_max} >= target {target_max}", ev)


# ---- tokenizer ----------------------------------------------------------------------------------
def check_tokenizer(tokenizer: Any | None, target_dir: str) -> Check:
    if tokenizer is None:
        return Check("tokenizer", FAIL, f"{target_dir} ships no tokenizer: prompts cannot be encoded, so "
                     "acceptance cannot be measured", {"present": False})
    return Check("tokenizer", PASS, f"{type(tokenizer).__name__}, {len(tokenizer)} tokens",
                 {"present": True, "size": len(tokenizer)})


def check_chat_template(tokenizer: Any | None) -> Check:
    if tokenizer is None:
        return Check("chat template", SKIP, "no tokenizer", {"present": False})
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return Check("chat template", WARN, "no chat template (tokenizer_config.json / chat_template.jinja): chat "
                     "requests reach the model as raw prompts or fail, and a drafter trained on templated "
                     "conversations sees text it never saw; prompts are scored raw here", {"present": False})
    return Check("chat template", PASS, f"present ({len(template)} chars); prompts are scored through it",
                 {"present": True, "chars": len(template)})
