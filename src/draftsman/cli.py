"""The `draftsman` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name}: CUDA is not available on this machine")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def add_device_args(p: argparse.ArgumentParser, dtype_default: str = "auto",
                    dtype_help: str = "default: bfloat16 on GPU, float32 on CPU") -> None:
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=dtype_default, choices=["auto", *DTYPES],
                   help=f"weights/activations dtype ({dtype_help})")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def print_json(obj: dict) -> None:
    """One JSON object on the last stdout line (the contract every --json output keeps)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# Subcommand modules under draftsman.commands, in --help order. Each module has a docstring
# (shown by `draftsman CMD --help`), HELP (one line), add_arguments(parser) and run(args).
COMMANDS = ["demo", "generate", "prepare-data", "train", "dump-hidden", "eval-drafter", "bench", "doctor", "serve",
            "export", "convert"]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="draftsman",
        description="EAGLE-3 speculative decoding: train drafters, decode losslessly, benchmark, diagnose.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"draftsman.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def resolve_target_arg(spec: str) -> str:
    """--target as a checkpoint directory (draftsman.target_source), or exit naming the fault.
    Anything but a .gguf file or a hub id passes unchanged: the command checks its other flags
    first and names a missing directory itself."""
    from draftsman.target_source import TargetSourceError, is_gguf, is_hub_id, resolve_target

    if not (is_gguf(spec) or is_hub_id(spec)):
        return spec
    try:
        return str(resolve_target(spec))
    except TargetSourceError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "target", None) and args.command != "export":
        args.target = resolve_target_arg(args.target)
    return int(args.func(args) or 0)


def run() -> NoReturn:
    """The `draftsman` command (and `python -m draftsman.cli`, as torchrun starts it): main(), then
    the exit; a torchrun rank leaves through trainer.exit_distributed with its process group."""
    code = main()
    dist = sys.modules.get("torch.distributed")  # (a group exists only if something imported it)
    if dist is not None and dist.is_available() and dist.is_initialized():
        from draftsman.train.trainer import exit_distributed

        exit_distributed(code)
    raise SystemExit(code)


if __name__ == "__main__":
    run()
