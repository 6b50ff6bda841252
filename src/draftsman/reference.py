"""The reference pair embedded in the package: a small DeepSeek-V3-architecture chat target and
its EAGLE-3 drafter, both trained with draftsman's own pipeline (see their model cards)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
TARGET_DIR = ASSETS / "reference-target"
DRAFTER_DIR = ASSETS / "reference-drafter"

# A handful of MT-bench-style first turns (written for the demo, not taken from MT-bench).
DEMO_PROMPTS = (
    "How do I sort a list of numbers in Python?",
    "Write a short email to a colleague asking to move our meeting to Friday.",
    "What are three tips for staying productive when working from home?",
    "Explain the difference between a list and a tuple in Python.",
    "A store sells pencils at 3 for $1. How much do 12 pencils cost?",
    "Give me a recipe for a simple tomato pasta.",
)


def reference_pair() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the embedded reference models."""
    missing = [str(p) for p in (TARGET_DIR, DRAFTER_DIR) if not (p / "config.json").exists()]
    if missing:
        raise FileNotFoundError(f"the embedded reference models are missing: {missing}")
    return TARGET_DIR, DRAFTER_DIR
