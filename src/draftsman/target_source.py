"""Where a target comes from: --target as a checkpoint directory, a .gguf file or a hub id.

Every command loads targets from an HF checkpoint directory. A GGUF file is dequantized once,
through transformers' GGUF reader, into a plain checkpoint in draftsman's cache (the same
one `draftsman convert --gguf` writes); a hub id is downloaded (or found in the local hub cache)
through huggingface_hub. Either way the rest of draftsman sees a directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# GGUF `general.architecture` values draftsman's models compute (and transformers reads).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Files a checkpoint directory needs, fetched from the hub (no optimizer states, no .bin/.pth).
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class TargetSourceError(ValueError):
    """--target names something draftsman cannot turn into a checkpoint directory."""


def cache_root() -> Path:
    """$DRAFTSMAN_CACHE, else $XDG_CACHE_HOME/draftsman, else ~/.cache/draftsman."""
    if os.environ.get("DRAFTSMAN_CACHE"):
        return Path(os.environ["DRAFTSMAN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftsman"


def is_gguf(spec: str | Path) -> bool:
    return str(spec).lower().endswith(".gguf")


def is_hub_id(spec: str | Path) -> bool:
    return not Path(spec).exists() and bool(HUB_ID.match(str(spec)))


def resolve_target(spec: str | Path) -> Path:
    """A checkpoint directory for --target: the directory itself, the converted checkpoint of a
    .gguf file (converted on first use, then cached), or the snapshot of a hub id."""
    path = Path(spec)
    if path.is_dir():
        return path
    if is_gguf(spec):
        if not path.is_file():
            raise TargetSourceError(f"--target {spec}: no such GGUF file")
        return cached_gguf_checkpoint(path)
    if is_hub_id(spec):
        return hub_snapshot(str(spec))
    if path.exists():
        raise TargetSourceError(f"--target {spec}: a file, but neither a checkpoint directory nor a .gguf file")
    raise TargetSourceError(f"--target {spec}: no such directory or .gguf file, and not a hub id (org/name)")


# ---- GGUF -----------------------------------------------------------------------------------------


def gguf_summary(gguf_file: Path) -> tuple[str, dict[str, list[str]]]:
    """(general.architecture, {quantization type: tensor names}) read from the file's header."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(gguf_file))
    except Exception as e:  # a truncated or foreign file: gguf raises ValueError/struct.error/...
        raise TargetSourceError(f"{gguf_file}: not a readable GGUF file ({e})") from e
    field = reader.fields.get("general.architecture")
    if field is None:
        raise TargetSourceError(f"{gguf_file}: the GGUF header has no general.architecture")
    types: dict[str, list[str]] = {}
    for t in reader.tensors:
        types.setdefault(t.tensor_type.name, []).append(t.name)
    return str(field.contents()), types


def check_gguf(gguf_file: Path) -> str:
    """The HF architecture of a GGUF file draftsman can convert; an error naming what it can't."""
    arch, types = gguf_summary(gguf_file)
    if arch not in GGUF_ARCHITECTURES:
        raise TargetSourceError(f"{gguf_file}: GGUF architecture {arch!r} is not supported "
                                f"(draftsman converts {', '.join(GGUF_ARCHITECTURES)})")
    readable = dequantizable_types()
    bad = {k: v for k, v in types.items() if readable and k not in readable}
    if bad:
        named = "; ".join(f"{k} ({len(v)} tensors, e.g. {v[0]})" for k, v in sorted(bad.items()))
        raise TargetSourceError(f"{gguf_file}: quantization types the gguf package cannot dequantize: {named}")
    return GGUF_ARCHITECTURES[arch]


def dequantizable_types() -> set[str]:
    _import_gguf()
    from gguf import quants

    # gguf keeps its table of dequantizers private; without it, let transformers name the type
    traits = getattr(quants, "_type_traits", None)
    if traits is None:
        return set()
    return {"F32", "F16", "F64", "I8", "I16", "I32", "I64"} | {t.name for t in traits}


def convert_gguf(gguf_file: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF file (transformers' reader) into a plain HF checkpoint directory:
    config.json, model.safetensors, generation_config.json and the tokenizer with its chat
    template. Written to a temporary sibling and renamed, so an interrupted run leaves nothing;
    an existing `out` is replaced only when it is an earlier conversion (its SOURCE.json)."""
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise TargetSourceError(f"--gguf {gguf_file}: no such file")
    if out.exists() and any(out.iterdir()) and not (out / "SOURCE.json").is_file():
        raise TargetSourceError(f"--out {out}: exists and is not a conversion draftsman wrote; "
                                "choose a new directory (nothing was changed)")
    architecture = check_gguf(gguf_file)
    _require_accelerate()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tensors = checkpoint_tensors(model)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are dequantized
    config.update(architectures=[architecture], dtype=str(dtype).removeprefix("torch."))
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.to_json_file(str(work / "generation_config.json"))
        tokenizer.save_pretrained(str(work))
        (work / "SOURCE.json").write_text(json.dumps(
            {"gguf": str(gguf_file.resolve()), "bytes": gguf_file.stat().st_size, "dtype": config["dtype"]}) + "\n")
        work.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as safetensors wants it: contiguous, untied (a tied lm_head is the
    embedding, written once as HF does)."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def cached_gguf_checkpoint(gguf_file: Path) -> Path:
    """The float32 checkpoint of a GGUF file in draftsman's cache, converted on first use. Keyed
    by the file's resolved path, size and modification time, so an edited file converts anew."""
    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "gguf" / f"{gguf_file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    print(f"converting {gguf_file} to a float32 checkpoint in {out} (once; later runs reuse it)", file=sys.stderr)
    return convert_gguf(gguf_file, out, torch.float32)


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise TargetSourceError("reading .gguf files needs the gguf package: pip install 'draftsman[gguf]'") from e
    return gguf


def _require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401  (transformers loads GGUF weights through it)
    except ImportError as e:
        raise TargetSourceError("reading .gguf files needs accelerate: pip install 'draftsman[gguf]'") from e


# ---- hub ------------------------------------------------------------------------------------------


def hub_snapshot(hub_id: str, patterns: list[str] = HUB_PATTERNS) -> Path:
    """A local snapshot of a hub checkpoint (`org/name` or `org/name@revision`): downloaded,
    or found in the hub cache when the hub can't be reached."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = hub_id.partition("@")
    kwargs = {"repo_id": repo_id, "revision": revision or None, "allow_patterns": patterns}
    try:
        path = Path(snapshot_download(**kwargs))
    except Exception as online_error:
        try:
            path = Path(snapshot_download(local_files_only=True, **kwargs))
        except Exception:
            raise TargetSourceError(
                f"--target {hub_id}: not a local path, and the Hugging Face hub could not be reached "
                f"({type(online_error).__name__}: {_first_line(online_error)}); nor is it in the local hub cache. "
                f"Download it where the hub is reachable (huggingface-cli download {repo_id} "
                f"--local-dir DIR), then pass --target DIR") from online_error
    if not (path / "config.json").is_file():
        raise TargetSourceError(f"--target {hub_id}: the hub repository has no config.json (a GGUF-only "
                                "repository? download its .gguf file and pass that path)")
    return path


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]
