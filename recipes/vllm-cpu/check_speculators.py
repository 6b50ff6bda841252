"""Load a `draftsman export --to speculators` directory through the `speculators` package's own
classes (run with the python of the vLLM virtual environment, where speculators is installed):
its config class, its model class, and every exported tensor equal to the one the model holds.

    /work/cache/vllm-venv/bin/python recipes/vllm-cpu/check_speculators.py EXPORT_DIR

Prints one JSON line {"config_class", "model_class", "aux_layer_ids", "draft_vocab_size",
"speculative_tokens", "norm_before_residual", "tensors", "equal", "missing"}; exits 1 unless every
tensor loaded equal.
"""

from __future__ import annotations

import json
import sys


def check(path: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(path)
    model = SpeculatorModel.from_pretrained(path)
    state = model.state_dict()
    written = load_file(f"{path}/model.safetensors")
    missing = sorted(k for k in written if k not in state)
    equal = sorted(k for k, v in written.items() if k in state and torch.equal(state[k].to(v.dtype), v))
    return {"config_class": type(cfg).__name__, "model_class": type(model).__name__,
            "aux_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids), "draft_vocab_size": cfg.draft_vocab_size,
            "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
            "norm_before_residual": cfg.norm_before_residual, "tensors": len(written), "equal": len(equal),
            "missing": missing}


if __name__ == "__main__":
    result = check(sys.argv[1])
    print(json.dumps(result))
    sys.exit(0 if result["equal"] == result["tensors"] and not result["missing"] else 1)
