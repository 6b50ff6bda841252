"""--target as a directory, a .gguf file or a hub id (draftsman.target_source), and the errors
that name what is wrong. Real GGUF conversion is tested on SmolLM2 in test_real_model.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftsman.cli import main
from draftsman.target_source import TargetSourceError, check_gguf, is_hub_id, resolve_target


def write_gguf(path: Path, arch: str, quant: str | None = None) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if quant is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[quant]
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, type_size), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture_is_named(tmp_path):
    with pytest.raises(TargetSourceError, match=r"phi\.gguf: GGUF architecture 'phi3' is not supported"):
        check_gguf(write_gguf(tmp_path / "phi.gguf", "phi3"))


def test_undequantizable_gguf_type_is_named_with_a_tensor(tmp_path):
    with pytest.raises(TargetSourceError, match=r"Q8_1 \(1 tensors, e\.g\. blk\.0\.attn_q\.weight\)"):
        check_gguf(write_gguf(tmp_path / "q81.gguf", "llama", quant="Q8_1"))


def test_cli_names_a_file_that_is_not_gguf(tmp_path, capsys):
    pytest.importorskip("gguf")
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(SystemExit, match=r"error: .*junk\.gguf: not a readable GGUF file"):
        main(["generate", "--target", str(bad), "--prompt-ids", "1,2"])
    with pytest.raises(SystemExit, match=r"error: --gguf .*missing\.gguf: no such file"):
        main(["convert", "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=r"--out .*mine: exists and is not a conversion draftsman wrote"):
        main(["convert", "--gguf", str(bad), "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_target_that_is_nothing_is_named(tmp_path):
    with pytest.raises(TargetSourceError, match=r"no such directory or \.gguf file, and not a hub id"):
        resolve_target(tmp_path / "nope" / "deeper")
    with pytest.raises(TargetSourceError, match="no such GGUF file"):
        resolve_target(tmp_path / "absent.gguf")
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name@v1.0")
    assert not is_hub_id(str(tmp_path)) and not is_hub_id("a/b/c") and not is_hub_id("plain")


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftsman.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_hub_id_from_the_local_hub_cache_and_offline_error(tiny_llama_dir, tmp_path):
    """A hub id found in the hub cache loads offline; one that is not names the id and says
    how to pass a local path instead."""
    repo, commit = tmp_path / "hub" / "models--acme--tiny-llama", "0" * 40
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_llama_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    done = _cli(["generate", "--target", "acme/tiny-llama", "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                 "--json"], env)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.splitlines()[-1])["token_ids"]) == 4

    done = _cli(["generate", "--target", "acme/absent-model", "--prompt-ids", "1"], env)
    assert done.returncode != 0
    assert "--target acme/absent-model: not a local path" in done.stderr
    assert "then pass --target DIR" in done.stderr
