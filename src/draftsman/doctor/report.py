"""The human-readable doctor report: one PASS / WARN / FAIL line per check, then the verdict; with
several drafters, a section each and a side-by-side table."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def check_lines(checks: list[dict[str, Any]]) -> list[str]:
    width = max((len(c["name"]) for c in checks), default=0)
    return [f"{c['status']:<4}  {c['name']:<{width}}  {c['message']}" for c in checks]


def drafter_section(report: dict[str, Any]) -> list[str]:
    lines = [f"drafter {report['drafter']}", *check_lines(report["checks"])]
    v = report["verdict"]
    lines.append(f"verdict ({v['kind']}): {v['message']}")
    return lines


def comparison_table(reports: list[dict[str, Any]]) -> list[str]:
    def row(label: str, values: list[str]) -> list[str]:
        return [label, *values]

    def tau(r: dict, key: str) -> str:
        live = r["live"].get(key) if r["live"] else None
        return _fmt(None if live is None else live.get("accept_length"))

    def count(r: dict) -> str:
        bad = [c for c in r["checks"] if c["status"] in ("FAIL", "WARN")]
        return r["status"] if not bad else f"{r['status']} ({len(bad)})"

    rows = [
        row("drafter", [f"#{i + 1}" for i in range(len(reports))]),
        row("checks", [count(r) for r in reports]),
        row("expected τ", [_fmt(r["expected"] and r["expected"]["accept_length"]) for r in reports]),
        row("step-0 acceptance", [_fmt(r["expected"] and r["expected"]["step_accept"][0]) for r in reports]),
        row("live τ (engine)", [tau(r, "engine") for r in reports]),
        row("live τ (server)", [tau(r, "server") for r in reports]),
        row("speed-up at bs 1", [_fmt(r["pay"] and r["pay"]["rows"][0]["speedup"]) + ("x" if r["pay"] else "")
                                 for r in reports]),
        row("verdict", [r["verdict"]["kind"] for r in reports]),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    out += [f"#{i + 1} = {r['drafter']}" for i, r in enumerate(reports)]
    return out


def format_report(result: dict[str, Any]) -> str:
    spec = result["spec"]
    shape = (f"a chain of {spec['steps']}" if spec["topk"] == 1 else
             f"a tree: steps {spec['steps']}, topk {spec['topk']}, {spec['draft_tokens']} draft tokens")
    template = {True: "chat template applied", False: "no chat template", None: "no prompts"}[result["chat_template"]]
    lines = [f"draftsman doctor: target {result['target']} ({result['target_layers']} layers)",
             f"  {result['num_prompts']} prompts from {result['dataset']} ({template}), greedy answers of up to "
             f"{result['max_new_tokens']} tokens; speculation: {shape}; {result['device']} {result['dtype']}"]
    if result.get("simulate"):
        lines.append(f"  simulating an integration fault in the live engine: {result['simulate']}")
    for note in result["notes"]:
        lines.append(f"  note: {note}")
    for report in result["drafters"]:
        lines += ["", *drafter_section(report)]
    if len(result["drafters"]) > 1:
        lines += ["", *comparison_table(result["drafters"])]
    lines += ["", f"overall: {result['status']}"]
    return "\n".join(lines)
