"""EAGLE-3 drafter training: data order, gradient accumulation, DDP / FSDP2, atomic resumable
checkpoints, logging. The maths (TTT forward, teacher, loss) lives in ttt.py.

One optimizer step = one GLOBAL batch of `batch_size` sequences, whatever the process count:
rank r of P takes sequences [r*B/P, (r+1)*B/P) of it, in micro-batches of `micro_batch_size`.
Each TTT step's loss is averaged over the masked positions of the whole global batch, so the
step first prepares every micro-batch (target forward or offline read: masks and teacher
inputs), all-reduces the per-step mask counts, then runs the drafter forward/backward per
micro-batch with those global denominators. DDP and FSDP average gradients over ranks, hence the
factor P on the loss. The data order is a permutation seeded by (seed, epoch) and the position in
it follows from the global step alone, so a resumed run continues with the next unseen batch.

Checkpoints: `OUT/checkpoints/step-NNNNNNN/` = a drafter directory (config.json,
model.safetensors: what the engine loads) + `training_state.pt` (model, optimizer, scheduler,
RNG states of every rank, step; plain tensors/dicts/lists only, read with weights_only=True).
Each is written into a temporary directory and renamed. At the end OUT itself becomes the drafter
directory and OUT/training_state/ holds the last training state.
"""

from __future__ import annotations

import abc
import atexit
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn

from draftsman.models.eagle3 import Eagle3Drafter, init_drafter, load_drafter, save_drafter
from draftsman.train.hidden_store import HeadOnlyTarget, HiddenStore, pad_stack
from draftsman.train.ttt import (
    Teacher,
    TTTModel,
    chain_acceptance,
    full_argmax,
    predicted_tau,
    step_mask,
    step_terms,
    step_weights,
    ttt_forward,
    ttt_objective,
)
from draftsman.weights import build_empty

__all__ = ["TrainConfig", "TrainResult", "evaluate", "train"]

STATE_FORMAT = 1
STATE_FILE = "training_state.pt"
DEFAULT_DRAFT_VOCAB = 32000


@dataclass
class TrainConfig:
    target: str
    out: str
    data: Sequence[str] = ()
    hidden_dir: str | None = None  # offline states from dump-hidden instead of --data
    init: str | None = None  # finetune this EAGLE-3 drafter
    aux_layers: Sequence[int] | None = None
    ttt_steps: int = 7
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps in this run
    lr: float = 1e-4
    batch_size: int = 16  # global, in sequences
    micro_batch_size: int = 1
    max_length: int = 2048
    num_samples: int | None = None  # use only the first N usable records of --data
    draft_vocab_size: int | None = None  # default 32000 (capped at the target vocabulary)
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    decay: float = 0.8  # TTT step weight decay^k
    resume: bool = False
    eval_data: str | None = None
    eval_samples: int = 64
    eval_every: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # the target's dtype; the drafter keeps fp32 master weights
    device_map: str | None = None  # spread the target over GPUs (one process; see load_target)
    drafter_hidden_size: int | None = None
    fsdp: bool = False
    progress: bool = True


@dataclass
class TrainResult:
    out: Path
    global_step: int
    total_steps: int
    losses: list[float] = field(default_factory=list)  # objective per optimizer step of this run
    interrupted: bool = False
    last_eval: dict[str, Any] | None = None


# ---- distributed --------------------------------------------------------------------------------
@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def init_distributed(device: torch.device) -> DistInfo:
    """A process group from torchrun's environment (nccl on CUDA, gloo on CPU), else one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # Torn down before interpreter exit: a group left to it can abort the process after
        # training is done (seen with gloo), which torchrun then reports as a failed run.
        atexit.register(_destroy_group)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_distributed(code: int) -> NoReturn:
    """End a torchrun rank whose command returned `code` (the CLI's exit, cli.run): after a
    success wait for every rank and tear the group down, then leave through os._exit. A rank that
    finished training aborted at interpreter exit in CI ("terminate called without an active
    exception": a native thread still joinable when static destructors ran), even with the group
    destroyed by atexit, and torchrun then reports the whole run failed. os._exit skips
    finalization and static destructors; what was written is flushed first (checkpoints are
    closed files by then)."""
    if code == 0 and dist.is_initialized():
        gc.collect()  # DDP's reducer holds the group: drop it before the group goes
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_sum(x: Tensor, info: DistInfo) -> Tensor:
    if info.active:
        x = x.clone()
        dist.all_reduce(x)
    return x


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


# ---- data ---------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One micro-batch ready for the drafter: inputs, masks and what the teacher needs."""

    input_ids: Tensor  # [b, T]
    loss_mask: Tensor  # [b, T] (0 on padding)
    aux: Tensor  # [b, T, 3H_target]
    token: Tensor  # [b, T] target argmax over the full vocabulary
    hidden: Tensor | None = None  # [b, T, H] final normed target states (probs via lm_head)
    draft_logits: Tensor | None = None  # [b, T, Vd] target logits over the draft vocabulary (dumped)


class Source(abc.ABC):
    """Examples by index, and how to turn a list of them into a MicroBatch."""

    def __init__(self, head: nn.Module, draft_token_ids: Tensor | None = None) -> None:
        self.head = head  # a TargetModel or HeadOnlyTarget: embedding + lm_head
        self.set_draft_vocab(draft_token_ids)

    def set_draft_vocab(self, draft_token_ids: Tensor | None) -> None:
        self.draft_ids = draft_token_ids
        if draft_token_ids is not None:
            self.draft_head = self.head.lm_head.weight[draft_token_ids.to(self.head.lm_head.weight.device)]

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of examples."""

    @abc.abstractmethod
    def length(self, i: int) -> int:
        """Token length of example i (for batching by length)."""

    @abc.abstractmethod
    def prepare(self, indices: Sequence[int]) -> MicroBatch:
        """Examples `indices` as one padded MicroBatch (target run online, or read from a dump)."""

    def teacher(self, mb: MicroBatch) -> Teacher:
        """Teacher distribution over the draft vocabulary, computed just before it is needed (it is
        the largest tensor of a step)."""
        if mb.draft_logits is not None:
            logits = mb.draft_logits
        else:
            logits = torch.nn.functional.linear(mb.hidden.to(self.draft_head.dtype), self.draft_head)
        return Teacher(logits.float().softmax(-1), mb.token)


class OnlineSource(Source):
    """Tokenized conversations; the frozen target runs inside the step (no_grad)."""

    def __init__(self, examples: Sequence, target: nn.Module, aux_layer_ids: Sequence[int]) -> None:
        super().__init__(target)
        self.examples, self.target, self.aux_ids = examples, target, tuple(aux_layer_ids)

    def __len__(self) -> int:
        return len(self.examples)

    def length(self, i: int) -> int:
        return len(self.examples[i].input_ids)

    @torch.no_grad()
    def prepare(self, indices: Sequence[int]) -> MicroBatch:
        device = self.head.embed_tokens.weight.device
        ex = [self.examples[i] for i in indices]
        ids = pad_stack([torch.tensor(e.input_ids) for e in ex]).to(device)
        mask = pad_stack([torch.tensor(e.loss_mask) for e in ex]).to(device)
        out = self.target.run(ids, aux_layer_ids=self.aux_ids, compute_logits=False)
        token = full_argmax(out.hidden, self.head.lm_head.weight)
        return MicroBatch(ids, mask, torch.cat(out.aux_hidden, -1), token, hidden=out.hidden)


class OfflineSource(Source):
    """A dump-hidden directory; the target's embedding and lm_head come from HeadOnlyTarget."""

    def __init__(self, store: HiddenStore, head: nn.Module) -> None:
        super().__init__(head)
        self.store = store
        self._lengths = [len(t.input_ids) for t in store.tokenized()]

    def __len__(self) -> int:
        return len(self.store)

    def length(self, i: int) -> int:
        return self._lengths[i]

    @torch.no_grad()
    def prepare(self, indices: Sequence[int]) -> MicroBatch:
        device = self.head.embed_tokens.weight.device
        names = ("input_ids", "loss_mask", "aux_hidden", "logits" if self.store.with_logits else "hidden")
        ex = [self.store.example(i, names) for i in indices]

        def stack(name: str) -> Tensor:
            return pad_stack([e[name] for e in ex]).to(device)

        ids, mask, aux = stack("input_ids"), stack("loss_mask"), stack("aux_hidden")
        if self.store.with_logits:
            logits = stack("logits")
            return MicroBatch(ids, mask, aux, logits.argmax(-1), draft_logits=logits[..., self.draft_ids.to(device)])
        hidden = stack("hidden")
        return MicroBatch(ids, mask, aux, full_argmax(hidden, self.head.lm_head.weight), hidden=hidden)


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The permutation of epoch `epoch`: a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def global_batch(n: int, batch_size: int, seed: int, step: int) -> tuple[int, list[int]]:
    """(epoch, example indices) of optimizer step `step` (0-based); the last partial batch of an
    epoch is dropped so every step has exactly `batch_size` sequences."""
    per_epoch = n // batch_size
    epoch, pos = divmod(step, per_epoch)
    order = data_order(n, seed, epoch)
    return epoch, order[pos * batch_size : (pos + 1) * batch_size]


def rank_micro_batches(indices: Sequence[int], lengths: Sequence[int], info: DistInfo, micro: int) -> list[list[int]]:
    """This rank's share of a global batch, in micro-batches of similar lengths (less padding)."""
    share = len(indices) // info.world
    mine = list(indices[info.rank * share : (info.rank + 1) * share])
    mine.sort(key=lambda i: -lengths[i])
    return [mine[j : j + micro] for j in range(0, len(mine), micro)]


# ---- schedule -----------------------------------------------------------------------------------
def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---- checkpoints --------------------------------------------------------------------------------
def checkpoint_dirs(out: Path) -> list[tuple[int, Path]]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / STATE_FILE).exists():
            found.append((int(p.name.removeprefix("step-")), p))
    return sorted(found)


def rng_state() -> dict[str, Any]:
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [py[0], list(py[1]), py[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))


def gather_rng(info: DistInfo) -> list[dict[str, Any]]:
    mine = rng_state()
    if not info.active:
        return [mine]
    out: list[Any] = [None] * info.world
    dist.all_gather_object(out, mine)  # transport only; the saved file holds plain tensors/lists
    return out


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded, CPU) model and optimizer state dicts, keyed by parameter name. Collective
    under DDP/FSDP: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, msd: dict, osd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))


def drafter_from_state(template: Eagle3Drafter, msd: dict[str, Tensor]) -> Eagle3Drafter:
    """A plain CPU fp32 drafter holding the weights of the (possibly sharded) training drafter."""
    d = build_empty(lambda: Eagle3Drafter(template.config, template.has_own_embedding), "cpu", torch.float32)
    d.load_state_dict({k.removeprefix("drafter."): v for k, v in msd.items() if k.startswith("drafter.")})
    d.aux_layer_ids, d.layer_ids_source = template.aux_layer_ids, template.layer_ids_source
    if template.target is not None:
        object.__setattr__(d, "_target", template.target)
    return d.eval()


def write_checkpoint(out: Path, step: int, drafter: Eagle3Drafter, state: dict[str, Any], keep: int) -> Path:
    """OUT/checkpoints/step-N written atomically (temp dir + rename); older ones pruned to `keep`."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_drafter(drafter, tmp)
    torch.save(state, tmp / STATE_FILE)
    if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
    for _, old in checkpoint_dirs(out)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish_final(out: Path, ckpt: Path) -> None:
    """OUT becomes the drafter directory (file by file, each replaced atomically) and
    OUT/training_state/ the last training state."""
    for name in ("config.json", "model.safetensors"):
        tmp = out / f".{name}.tmp"
        shutil.copyfile(ckpt / name, tmp)
        os.replace(tmp, out / name)
    tmp_dir = out / ".training_state.tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    shutil.copyfile(ckpt / STATE_FILE, tmp_dir / STATE_FILE)
    (tmp_dir / "checkpoint.txt").write_text(f"{ckpt.name}\n")
    old = out / "training_state"
    if old.exists():
        shutil.rmtree(old)
    os.rename(tmp_dir, old)


def clean_stale(out: Path) -> None:
    root = out / "checkpoints"
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)


# ---- evaluation ---------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(drafter: Eagle3Drafter, source: Source, indices: Sequence[int], steps: int,
             micro_batch_size: int = 4, autocast: bool = False) -> dict[str, Any]:
    """Teacher-forced per-step top-1 acceptance over `indices` (masked by loss_mask only: a target
    choice outside the draft vocabulary counts as a miss, as at inference) and the tau it predicts
    for a chain of depth `steps`.

    tau_pred = 1 + sum_k prod_{j<=k} a_j assumes independence across steps; tau_chain uses the
    joint event "steps 0..k all correct at the same index" instead (no such assumption)."""
    was_training = drafter.training
    drafter.eval()
    draft_ids = drafter.draft_token_ids
    hits = torch.zeros(steps, dtype=torch.long)
    counts = torch.zeros(steps, dtype=torch.long)
    in_vocab = torch.zeros(steps, dtype=torch.long)
    chain_hit = torch.zeros(steps, dtype=torch.long)
    chain_n = torch.zeros(steps, dtype=torch.long)
    loss = torch.zeros(steps, dtype=torch.float64)
    lengths = [source.length(i) for i in indices]
    order = sorted(range(len(indices)), key=lambda j: -lengths[j])
    for j in range(0, len(order), micro_batch_size):
        mb = source.prepare([indices[o] for o in order[j : j + micro_batch_size]])
        teacher = source.teacher(mb)
        masks, hit_rows = [], []
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext()
        with ctx:
            hidden = drafter.project(mb.aux)
            for k, logits in enumerate(ttt_forward(drafter, mb.input_ids, hidden, steps)):
                s, c, h, m, hit = step_terms(logits, teacher, mb.loss_mask, draft_ids, None, k)
                loss[k] += float(s)
                counts[k] += int(c)
                hits[k] += int(h)
                in_vocab[k] += int(step_mask(mb.loss_mask, mb.token, drafter.t2d, k).sum())
                masks.append(m)
                hit_rows.append(hit)
        acc, cnt = chain_acceptance(masks, hit_rows)
        chain_hit += torch.tensor(acc)
        chain_n += torch.tensor(cnt)
    drafter.train(was_training)
    rate = (hits / counts.clamp(min=1)).tolist()
    chain = (chain_hit / chain_n.clamp(min=1)).tolist()
    return {
        "num_samples": len(indices),
        "ttt_steps": steps,
        "positions_per_step": counts.tolist(),
        "acceptance_per_step": [round(a, 6) for a in rate],
        "tau_pred": round(predicted_tau(rate), 6),
        "chain_acceptance": [round(a, 6) for a in chain],
        "tau_chain": round(1.0 + sum(chain), 6),
        "draft_vocab_coverage": round(float(in_vocab[0]) / max(1, int(counts[0])), 6),
        "loss_per_step": [round(float(v) / max(1, int(n)), 6) for v, n in zip(loss, counts, strict=True)],
    }


# ---- setup --------------------------------------------------------------------------------------
def _resolve(cfg: TrainConfig) -> tuple[torch.device, torch.dtype]:
    from draftsman.cli import resolve_device, resolve_dtype

    device = resolve_device(cfg.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    return device, resolve_dtype(cfg.dtype, device)


def load_tokenized(target_dir: str, paths: Sequence[str], max_length: int, num_samples: int | None) -> list:
    from draftsman.tokenizer import load_tokenizer
    from draftsman.train.data import tokenize_file

    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise ValueError(f"{target_dir} has no tokenizer: --data needs one (or train from --hidden-dir)")
    examples: list = []
    for p in paths:
        left = None if num_samples is None else num_samples - len(examples)
        if left is not None and left <= 0:
            break
        examples += tokenize_file(tokenizer, p, max_length, left)
    return examples


def tokenizer_fingerprint(target_dir: str) -> str:
    from draftsman.tokenizer import TOKENIZER_FILES
    from draftsman.train.vocab import fingerprint_files

    files = [Path(target_dir) / f for f in TOKENIZER_FILES if (Path(target_dir) / f).exists()]
    return fingerprint_files(files) if files else ""


def examples_fingerprint(examples: Sequence) -> str:
    import hashlib

    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.input_ids, e.loss_mask]).encode())
    return h.hexdigest()


def data_key(cfg: TrainConfig, examples: Sequence | None = None) -> dict[str, Any]:
    """Everything the token data depends on (the vocabulary cache key)."""
    from draftsman.train.vocab import fingerprint_files

    if examples is not None:
        return {"examples": examples_fingerprint(examples)}
    if cfg.hidden_dir:
        return {"hidden_dir": json.loads((Path(cfg.hidden_dir) / "index.json").read_text())["meta"]}
    return {"data": fingerprint_files(list(cfg.data)), "tokenizer": tokenizer_fingerprint(cfg.target),
            "max_length": cfg.max_length, "num_samples": cfg.num_samples}


def build_drafter(cfg: TrainConfig, head: nn.Module, device: torch.device, examples_factory,
                  fixed_aux: Sequence[int] | None, key: dict[str, Any]) -> Eagle3Drafter:
    """--init drafter (refusing contradicting flags) or a new one with the cached draft vocabulary."""
    tcfg = head.config
    if cfg.init:
        d = load_drafter(cfg.init, target=head, device=device, dtype=torch.float32)
        if cfg.aux_layers is not None and tuple(cfg.aux_layers) != tuple(d.aux_layer_ids):
            raise ValueError(f"--aux-layers {list(cfg.aux_layers)} contradicts the --init drafter's aux layer ids "
                             f"{list(d.aux_layer_ids)} ({d.layer_ids_source})")
        if cfg.draft_vocab_size is not None and cfg.draft_vocab_size != d.config.draft_vocab_size:
            raise ValueError(f"--draft-vocab-size {cfg.draft_vocab_size} contradicts the --init drafter's "
                             f"draft_vocab_size {d.config.draft_vocab_size}")
        if cfg.drafter_hidden_size is not None and cfg.drafter_hidden_size != d.config.hidden_size:
            raise ValueError(f"--drafter-hidden-size {cfg.drafter_hidden_size} contradicts the --init drafter's "
                             f"hidden_size {d.config.hidden_size}")
        if fixed_aux is not None and tuple(fixed_aux) != tuple(d.aux_layer_ids):
            raise ValueError(f"the --hidden-dir dump holds aux layers {list(fixed_aux)}, but the --init drafter "
                             f"reads {list(d.aux_layer_ids)}")
        return d.train()
    from draftsman.train.vocab import cached_vocab_mapping

    aux = tuple(cfg.aux_layers) if cfg.aux_layers is not None else (
        tuple(fixed_aux) if fixed_aux is not None else tuple(tcfg.default_aux_layer_ids()))
    if fixed_aux is not None and tuple(fixed_aux) != aux:
        raise ValueError(f"--aux-layers {list(aux)} contradicts the --hidden-dir dump's {list(fixed_aux)}")
    n = min(cfg.draft_vocab_size or DEFAULT_DRAFT_VOCAB, tcfg.vocab_size)
    mapping = cached_vocab_mapping(examples_factory, tcfg.vocab_size, n, Path(cfg.out) / "cache",
                                   key=key)
    return init_drafter(head, hidden_size=cfg.drafter_hidden_size, draft_vocab_size=n, aux_layer_ids=aux,
                        draft_token_ids=mapping.draft_token_ids, seed=cfg.seed, device=device,
                        dtype=torch.float32).train()


def wrap(model: TTTModel, cfg: TrainConfig, info: DistInfo, device: torch.device) -> nn.Module:
    if not info.active:
        return model
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit: the TTT forward calls the layer's submodules directly, so only the
        # root's hooks are guaranteed to run (a drafter is one layer; sharding saves optimizer memory).
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


# Fields a resumed run must share with the run it continues (the rest may change, e.g. eval).
RESUME_KEYS = ("batch_size", "seed", "ttt_steps", "lr", "warmup_ratio", "weight_decay", "decay", "max_length",
               "num_samples", "hidden_dir", "fsdp")


class _StopFlag:
    """SIGINT/SIGTERM ask for a clean stop: finish the step, write a checkpoint, exit."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


# ---- the loop -----------------------------------------------------------------------------------
def train(cfg: TrainConfig, examples: Sequence | None = None, eval_examples: Sequence | None = None) -> TrainResult:
    """Run (or resume) a training job. `examples` / `eval_examples` (TokenizedConversation lists)
    stand in for --data / --eval-data files, for callers that tokenize themselves."""
    device, tdtype = _resolve(cfg)
    info = init_distributed(device)
    out = Path(cfg.out)
    if info.main:
        out.mkdir(parents=True, exist_ok=True)
        clean_stale(out)
    barrier(info)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    # -- resume point
    ckpts = checkpoint_dirs(out) if cfg.resume else []
    if not cfg.resume and checkpoint_dirs(out):
        raise ValueError(f"{out} already holds checkpoints: pass --resume to continue, or use a new --out")
    state = torch.load(ckpts[-1][1] / STATE_FILE, map_location="cpu", weights_only=True) if ckpts else None
    if state is not None:
        old = state["config"]
        changed = [k for k in RESUME_KEYS if old.get(k) != config_record(cfg).get(k)]
        if changed:
            raise ValueError(f"--resume: {changed} differ from the run being resumed ({ckpts[-1][1]})")

    # -- target (or its head) and data
    if cfg.hidden_dir:
        store = HiddenStore(cfg.hidden_dir)
        head = HeadOnlyTarget.load(cfg.target, device, tdtype)
        if store.index["vocab_size"] != head.config.vocab_size or store.index["hidden_size"] != head.config.hidden_size:
            raise ValueError(f"--hidden-dir {cfg.hidden_dir} was dumped from another target geometry")
        source: Source = OfflineSource(store, head)
        fixed_aux: tuple[int, ...] | None = store.aux_layer_ids
        examples_factory = store.tokenized
        given = False
    else:
        from draftsman.models import load_target

        if not cfg.data and examples is None:
            raise ValueError("give --data FILE(S) or --hidden-dir DIR")
        head = load_target(cfg.target, device=device, dtype=tdtype, device_map=cfg.device_map)
        given = examples is not None
        if not given:
            examples = load_tokenized(cfg.target, cfg.data, cfg.max_length, cfg.num_samples)
        source = None  # built once the aux layer ids are known
        fixed_aux = None
        examples_factory = lambda: examples  # noqa: E731
    key = data_key(cfg, examples if not cfg.hidden_dir and given else None)

    if state is not None:
        drafter = load_drafter(ckpts[-1][1], target=head, device=device, dtype=torch.float32).train()
    else:
        if info.main:  # rank 0 builds the vocab cache first; the others then read it
            drafter = build_drafter(cfg, head, device, examples_factory, fixed_aux, key)
        barrier(info)
        if not info.main:
            drafter = build_drafter(cfg, head, device, examples_factory, fixed_aux, key)
    if source is None:
        source = OnlineSource(examples, head, drafter.aux_layer_ids)
    source.set_draft_vocab(drafter.draft_token_ids)

    n = len(source)
    if n < cfg.batch_size:
        raise ValueError(f"{n} training examples, fewer than one global batch of {cfg.batch_size}")
    if cfg.batch_size % (info.world * cfg.micro_batch_size):
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of processes ({info.world}) x "
                         f"--micro-batch-size ({cfg.micro_batch_size})")
    per_epoch = n // cfg.batch_size
    total = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * per_epoch
    warmup = math.ceil(cfg.warmup_ratio * total)

    model = wrap(TTTModel(drafter, cfg.ttt_steps), cfg, info, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                  betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))
    step = 0
    if state is not None:
        load_full_state(model, optimizer, state["model"], state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if len(rngs) == info.world else rngs[0])
        step = int(state["global_step"])

    eval_source, eval_idx = _eval_setup(cfg, head, drafter, info, eval_examples)
    log_path = out / "train_log.jsonl"
    if info.main:
        _truncate_log(log_path, step)
        _truncate_log(out / "eval_log.jsonl", step)
    weights = step_weights(cfg.ttt_steps, cfg.decay)
    autocast = device.type == "cuda"
    result = TrainResult(out, step, total)
    bar = _progress(cfg, info, step, total)
    stop_at = total if cfg.stop_after is None else min(total, step + cfg.stop_after)
    with _StopFlag() as stop:
        while step < stop_at:
            t0 = time.perf_counter()
            epoch, batch = global_batch(n, cfg.batch_size, cfg.seed, step)
            micro = rank_micro_batches(batch, _Lengths(source), info, cfg.micro_batch_size)
            stats = _train_step(model, source, micro, weights, cfg, info, autocast)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            tokens = int(sum(source.length(i) for i in batch))
            record = _log_record(step, epoch, stats, weights, lr, float(grad_norm), tokens, dt)
            result.losses.append(record["loss"])
            if info.main:
                with log_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(_postfix(record))
            requested = all_sum(torch.tensor([float(stop.requested)], device=device), info).item() > 0
            done = step >= stop_at or requested
            if eval_source is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total):
                result.last_eval = _run_eval(model, optimizer, drafter, eval_source, eval_idx, cfg, info, out,
                                             step, autocast)
            if done or (cfg.save_every and step % cfg.save_every == 0):
                ckpt = _save(model, optimizer, scheduler, drafter, cfg, info, out, step, epoch, total)
                if info.main and step >= total:
                    publish_final(out, ckpt)
                barrier(info)
            if requested:
                result.interrupted = True
                break
    if bar is not None:
        bar.close()
    result.global_step = step
    if result.interrupted or step < total:
        result.interrupted = True
    return result


class _Lengths:
    """Lazy lengths view (a Source's lengths without building a list per step)."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def __getitem__(self, i: int) -> int:
        return self.source.length(i)


def _train_step(model: nn.Module, source: Source, micro: list[list[int]], weights: list[float],
                cfg: TrainConfig, info: DistInfo, autocast: bool) -> dict[str, Tensor]:
    """Prepare every micro-batch (global per-step denominators), then forward/backward each."""
    inner: TTTModel = model.module if hasattr(model, "module") else model
    t2d = inner.drafter.t2d
    steps = cfg.ttt_steps
    prepared = [source.prepare(m) for m in micro]
    device = t2d.device
    local = torch.zeros(steps, dtype=torch.float64, device=device)
    for mb in prepared:
        for k in range(steps):
            local[k] += step_mask(mb.loss_mask, mb.token, t2d, k).sum()
    counts = all_sum(local, info).float()
    loss_sum = torch.zeros(steps, dtype=torch.float64, device=device)
    correct = torch.zeros(steps, dtype=torch.float64, device=device)
    for j, mb in enumerate(prepared):
        last = j == len(prepared) - 1
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(last)
            sync = nullcontext()
        else:
            sync = model.no_sync() if (info.active and not last) else nullcontext()
        teacher = source.teacher(mb)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext()
        with sync:
            with ctx:
                sums, _, hits = model(mb.input_ids, mb.aux, mb.loss_mask, teacher.probs, teacher.token)
            loss = ttt_objective(sums, counts, weights) * info.world
            loss.backward()
        loss_sum += sums.detach().double()
        correct += hits.double()
        prepared[j] = None  # free the step's largest tensors early
    return {"loss_sum": all_sum(loss_sum, info), "correct": all_sum(correct, info), "count": counts.double()}


def _log_record(step: int, epoch: int, stats: dict[str, Tensor], weights: list[float], lr: float,
                grad_norm: float, tokens: int, dt: float) -> dict[str, Any]:
    count = stats["count"].clamp(min=1)
    per_step = (stats["loss_sum"] / count).tolist()
    acc = (stats["correct"] / count).tolist()
    loss = sum(w * v for w, v in zip(weights, per_step, strict=True))
    return {"step": step, "epoch": epoch, "loss": loss, "loss_per_step": per_step, "acc_per_step": acc,
            "positions_per_step": [int(c) for c in stats["count"].tolist()], "lr": lr, "grad_norm": grad_norm,
            "tokens": tokens, "tokens_per_s": tokens / dt if dt > 0 else 0.0, "time_s": dt}


def _postfix(r: dict[str, Any]) -> str:
    acc = " ".join(f"{a:.2f}" for a in r["acc_per_step"])
    return f"loss {r['loss']:.3f} acc [{acc}] {r['tokens_per_s']:.0f} tok/s"


def _progress(cfg: TrainConfig, info: DistInfo, step: int, total: int):
    if not (cfg.progress and info.main):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=step, desc="train", dynamic_ncols=True)


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past the resumed step (written after the last checkpoint before a stop)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _save(model, optimizer, scheduler, drafter, cfg, info, out, step, epoch, total) -> Path | None:
    msd, osd = full_state(model, optimizer)
    rngs = gather_rng(info)
    if not info.main:
        return None
    state = {"format": STATE_FORMAT, "global_step": step, "epoch": epoch, "total_steps": total,
             "world_size": info.world, "model": msd, "optimizer": osd, "scheduler": scheduler.state_dict(),
             "rng": rngs, "config": config_record(cfg)}
    return write_checkpoint(out, step, drafter_from_state(drafter, msd), state, cfg.keep_checkpoints)


def _eval_setup(cfg: TrainConfig, head, drafter, info, eval_examples):
    if not cfg.eval_data and eval_examples is None:
        return None, []
    if eval_examples is not None:
        src: Source = OnlineSource(eval_examples, head, drafter.aux_layer_ids)
    elif Path(cfg.eval_data).is_dir():
        src = OfflineSource(HiddenStore(cfg.eval_data), head)
    elif cfg.hidden_dir:
        raise ValueError("--eval-data: with --hidden-dir, give a dump-hidden directory (the target's layers "
                         "are not loaded)")
    else:
        ex = load_tokenized(cfg.target, [cfg.eval_data], cfg.max_length, cfg.eval_samples)
        src = OnlineSource(ex, head, drafter.aux_layer_ids)
    src.set_draft_vocab(drafter.draft_token_ids)
    return src, list(range(min(len(src), cfg.eval_samples)))


def _run_eval(model, optimizer, drafter, source, indices, cfg, info, out, step, autocast) -> dict | None:
    """Rank 0 evaluates a plain copy of the current weights (gathered: works for FSDP too)."""
    if cfg.fsdp and info.active:
        msd, _ = full_state(model, optimizer)
        plain = drafter_from_state(drafter, msd).to(drafter.fc.weight.device) if info.main else None
    else:
        plain = drafter
    res = None
    if info.main:
        res = evaluate(plain, source, indices, cfg.ttt_steps, max(1, cfg.micro_batch_size), autocast)
        with (out / "eval_log.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, **res}) + "\n")
    barrier(info)
    return res
