"""Target model families and the loader that picks one from config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from draftsman.config import TargetConfig, load_target_config
from draftsman.models.base import TargetModel, TargetOutput
from draftsman.weights import build_empty, load_checkpoint_into

__all__ = ["TargetModel", "TargetOutput", "build_target", "load_target"]


def build_target(config: TargetConfig) -> TargetModel:
    """An uninitialised-but-allocated model of the config's family (on the current device)."""
    if config.family == "deepseek":
        from draftsman.models.deepseek import DeepseekV3Model

        return DeepseekV3Model(config)
    from draftsman.models.llama import LlamaModel

    return LlamaModel(config)


def load_target(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> TargetModel:
    """Load an HF checkpoint directory as a draftsman target model in eval mode."""
    config = load_target_config(path)
    model = build_empty(lambda: build_target(config), device, dtype)
    model.tie_weights()
    prefix = config.weight_prefix

    def name_map(name: str):
        if prefix:
            if not name.startswith(prefix):
                return "skip"  # e.g. a vision tower beside the text backbone
            name = name.removeprefix(prefix)
        return model.checkpoint_name(name)

    load_checkpoint_into(model, path, name_map, device, dtype)
    model.source_dir = Path(path)
    return model.eval().requires_grad_(False)
