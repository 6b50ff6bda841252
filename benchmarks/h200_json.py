"""benchmarks/h200.json: the GPU issue's headline figures, merged in by each benchmark script."""

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
