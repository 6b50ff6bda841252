"""docs/deploy.md is executable: every ```bash cpu-test block runs, in order, on CPU with a tiny
chat model as $TARGET and `draftsman serve` standing in for SGLang/vLLM; sizes are scaled down
by CPU_SIZES (each entry must still appear in the guide, so the table cannot go stale). Blocks
that stay untested are engine launches and the variable setup, nothing else."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import draftsman
from draftsman.cli import COMMANDS
from draftsman.cli import main as cli_main
from draftsman.interop.launch import Server, free_port

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"

# literal flag in the guide -> what the CPU run uses instead (GPU-sized runs, a tiny model)
CPU_SIZES = {
    "--max-new-tokens 2048": "--max-new-tokens 8",
    "--concurrency 128": "--concurrency 4",
    "--nproc-per-node 8": "--nproc-per-node 2",
    "--epochs 2": "--epochs 1",
    "--batch-size 64": "--batch-size 4",
    "--micro-batch-size 2": "--micro-batch-size 1",
    "--draft-vocab-size 32000": "--draft-vocab-size 64",
    "--num-prompts 80": "--num-prompts 3",
    "--batch-sizes 1,8,32": "--batch-sizes 1,2",
    "--max-new-tokens 256": "--max-new-tokens 8",
    "--num-prompts 16": "--num-prompts 2",
}
# need GPUs / set variables / the vLLM virtual environment (tests/test_vllm.py, -m vllm)
UNTESTED = ("python -m sglang.launch_server", "vllm serve", "export ", "bash recipes/vllm-cpu/",
            "DRAFTSMAN_VLLM_PYTHON=")


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)


def commands(body: str) -> list[str]:
    return [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]


def test_readme_links_the_guide():
    assert "docs/deploy.md" in (ROOT / "README.md").read_text()


def test_only_engine_launches_are_left_untested():
    found = blocks(DOC.read_text())
    assert any(info.startswith("bash cpu-test") for info, _ in found)
    for info, body in found:
        if info.strip() == "bash":
            for cmd in commands(body):
                assert cmd.startswith(UNTESTED), f"runnable on CPU but not marked cpu-test: {cmd}"
    text = DOC.read_text()
    for flag in CPU_SIZES:
        assert flag in text, f"CPU_SIZES entry {flag!r} no longer appears in the guide"


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 eos_token_id=2)).save_pretrained(path)
    words = [f"w{i}" for i in range(100)]
    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(path)
    return path


def run_command(cmd: str, env: dict[str, str], cwd: Path) -> str:
    """A `draftsman ...` line runs in this process through the CLI entry point (saving an
    interpreter start per command); anything else (torchrun) in bash. Returns stdout."""
    words = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in shlex.split(cmd)]
    if words[0] == "draftsman":
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = cli_main(words[1:])
        except SystemExit as e:
            raise AssertionError(f"{cmd}\nexited: {e}\n{out.getvalue()[-3000:]}") from None
        assert rc == 0, f"{cmd}\n{out.getvalue()[-3000:]}"
        return out.getvalue()
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, f"{cmd}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
    return res.stdout


class Servers:
    """`draftsman serve` processes standing in for the engines (started and stopped here only)."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.servers = logs, []

    def start(self, *args: str) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "draftsman.cli", "serve", *args, "--port", str(port), "--device", "cpu"]
        server = Server("draftsman serve", cmd, port, self.logs / f"serve-{port}.log")
        self.servers.append(server)
        return server.start(timeout_s=90).url

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def test_every_cpu_command_of_the_guide_runs(chat_target, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    prompts = work / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"id": str(i), "conversations": [{"from": "human", "value": f"w{i} w{i + 7} w{i + 2}"},
                                                                {"from": "gpt", "value": "w1 w2"}]}) + "\n")
    servers = Servers(tmp_path)
    env = dict(os.environ, TARGET=str(chat_target), WORK=str(work), PROMPTS=str(prompts), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    ran, skipped = [], []
    try:
        env["TARGET_SERVER"] = env["BASELINE_SERVER"] = servers.start("--target", str(chat_target))
        for info, body in blocks(DOC.read_text()):
            if not info.startswith("bash cpu-test"):
                continue
            required = re.findall(r"requires=(\S+)", info)
            if any(r not in COMMANDS for r in required):
                skipped.append(body)  # a subcommand not registered in this tree yet
                continue
            if "$SPEC_SERVER" in body and "SPEC_SERVER" not in env:
                # the engine of step 5: target + the exported drafter, a chain of 3
                env["SPEC_SERVER"] = servers.start("--target", str(chat_target), "--drafter",
                                                   str(work / "drafter-sglang"), "--spec-steps", "3",
                                                   "--spec-topk", "1", "--spec-draft-tokens", "4")
            for big, small in CPU_SIZES.items():
                body = body.replace(big, small)
            for cmd in commands(body):
                ran.append((cmd, run_command(cmd, env, tmp_path)))
    finally:
        servers.stop()

    assert len(ran) >= 7
    assert len((work / "regen.jsonl").read_text().splitlines()) == 8
    assert (work / "states" / "index.json").exists()
    trained = draftsman.load_drafter(work / "drafter")
    for fmt in ("sglang", "vllm", "speculators"):
        exported = draftsman.load_drafter(work / f"drafter-{fmt}")
        assert exported.aux_layer_ids == trained.aux_layer_ids == (2, 4, 5)
        assert torch.equal(exported.fc.weight, trained.fc.weight.to(exported.fc.weight.dtype))
    bench = json.loads(next(out for body, out in ran if "draftsman bench" in body).strip().splitlines()[-1])
    assert bench["mode"] == "client" and bench["accept_length"] is not None
