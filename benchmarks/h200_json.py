"""Results files of the benchmark scripts, and benchmarks/h200.json: the GPU issue's headline
figures, merged in by each of them."""

from __future__ import annotations

import json
from pathlib import Path


def update_h200_json(path: str | Path, figures: dict, source: str) -> None:
    """Merge `figures` into the JSON at `path`, recording for each key the results file it came from."""
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {"gpu": "NVIDIA H200", "sources": {}}
    data |= figures
    data.setdefault("sources", {}).update({k: source for k in figures})
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_results(path: str | Path | None, data: dict) -> None:
    """A script's --out file (its folder made as needed); nothing without a path."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")
