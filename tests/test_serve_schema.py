"""Property-based run of schemathesis over the served OpenAPI schema: no input yields a 5xx.

Every check runs except positive_data_acceptance: the schema cannot express limits that depend
on the model (prompt length against --max-model-len, token ids against the vocabulary), so a
schema-valid request may rightly get a 400. Bounded: few examples per operation, a short
context (so generation is short), a time limit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_generate import make_tokenizer
from test_serve import LiveServer

from draftsman.serve import load_state

pytest.importorskip("schemathesis")


def test_schemathesis_finds_no_server_error(tiny_llama_dir, tmp_path):
    target = shutil.copytree(tiny_llama_dir, tmp_path / "tiny")
    make_tokenizer(target)
    with LiveServer(load_state(target, max_model_len=32)) as server:
        cli = Path(sys.executable).with_name("schemathesis")
        cmd = [str(cli) if cli.exists() else "schemathesis", "run", server.url + "/openapi.json",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "5",
               "--seed", "1", "--request-timeout", "30", "--max-failures", "5", "--no-color",
               "--report", "junit", "--report-dir", str(tmp_path / "report")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
        assert "generated" in res.stdout
        # the server is unharmed
        assert server.post("/v1/completions", {"prompt": "hello", "max_tokens": 2}).status_code == 200
