"""Build a server from checkpoint directories and run it under uvicorn with graceful shutdown."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from draftsman.serve.app import ServeState, create_app
from draftsman.serve.metrics import ServeMetrics
from draftsman.serve.scheduler import Scheduler, SessionFactory

DEFAULT_MAX_MODEL_LEN = 4096  # cache rows are allocated at this length: keep it modest by default

logger = logging.getLogger("draftsman.serve")


def load_state(
    target: str | Path,
    drafter: str | Path | None = None,
    spec=None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **options,
) -> ServeState:
    """Load a target checkpoint (its tokenizer and EOS ids) and a drafter directory, then
    `build_state`; `options` are build_state's keywords. The model name defaults to the target
    directory's name."""
    from draftsman.models import load_target
    from draftsman.tokenizer import eos_token_ids, load_tokenizer

    model = load_target(target, device=device, dtype=dtype)
    tokenizer = load_tokenizer(target)
    eos = frozenset(eos_token_ids(target, model.config.eos_token_ids, tokenizer))
    draft = None
    if drafter is not None:
        from draftsman.models.eagle3 import load_drafter

        draft = load_drafter(drafter, target=model, device=device, dtype=model.lm_head.weight.dtype,
                              inference=True)
    options["model_name"] = options.get("model_name") or Path(target).resolve().name
    return build_state(model, tokenizer, eos, draft, spec, **options)


def build_state(
    model,
    tokenizer,
    eos_ids: frozenset[int],
    drafter=None,
    spec=None,
    max_model_len: int | None = None,
    max_batch_size: int = 32,
    model_name: str = "draftsman",
    api_key: str | None = None,
    adaptive: bool = False,
    candidates=None,
    join_wait_rounds: int = 8,
    threads: int | None = None,
) -> ServeState:
    """Wire a loaded target (and drafter) to a scheduler, metrics and the tokenizer.

    With a drafter, speculation is adaptive unless `spec` pins a shape: one AdaptivePolicy for
    all sessions runs, each round, one of `candidates` (default DEFAULT_CANDIDATES; `spec` alone
    with adaptive=True) or a plain step, whichever round times and acceptance measured while
    serving say is fastest at the running batch (spec/adaptive.py). `spec` without adaptive:
    every round speculates with it.

    join_wait_rounds: the most rounds freed batch slots wait to be refilled together
    (joins.JoinCoalescer; 0: at once). threads: intra-op threads of the scheduler thread (Scheduler).

    max_model_len bounds prompt + generated tokens of one request (a cache row has this many
    slots); it defaults to the target's max_position_embeddings capped at DEFAULT_MAX_MODEL_LEN,
    and may not exceed the former."""
    from draftsman.session import PlainSession

    limit = model.config.max_position_embeddings
    max_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    if not 2 <= max_len <= limit:
        raise ValueError(f"--max-model-len {max_len} must lie in [2, {limit}] (the target's "
                         "max_position_embeddings)")
    metrics = ServeMetrics(model_name)
    new_session: SessionFactory
    if drafter is None:
        if spec is not None or adaptive or candidates:
            raise ValueError("speculation settings need a drafter")
        new_session = lambda seed: PlainSession(model, max_len, seed)  # noqa: E731
        steps = per_round = 0
    else:
        from draftsman.spec.adaptive import DEFAULT_CANDIDATES, AdaptivePolicy
        from draftsman.spec.engine import SpecSession

        if spec is not None and candidates:
            raise ValueError("give a speculation shape (spec) or adaptive candidates, not both")
        if spec is not None and not adaptive:
            shapes = [spec]
            new_session = lambda seed: SpecSession(model, drafter, spec, max_len, seed)  # noqa: E731
        else:
            shapes = [spec] if spec is not None else list(candidates or DEFAULT_CANDIDATES)
            policy = AdaptivePolicy(shapes)
            new_session = lambda seed: SpecSession(model, drafter, None, max_len, seed, policy=policy)  # noqa: E731
        steps, per_round = max(c.steps for c in shapes), max(c.draft_tokens for c in shapes) - 1
        metrics.init_positions(steps)
    scheduler = Scheduler(new_session, max_batch_size, metrics, per_round, join_wait_rounds, threads)
    return ServeState(scheduler=scheduler, metrics=metrics, tokenizer=tokenizer, eos_ids=eos_ids,
                      vocab_size=model.config.vocab_size, model_name=model_name, max_model_len=max_len,
                      api_key=api_key or None, spec_steps=steps, draft_tokens_per_round=per_round)


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop admitting (new requests get 503, the listening socket closes), let
    in-flight requests finish for up to the graceful-shutdown timeout (then cancel them), stop
    the scheduler, and exit with status 0."""

    def __init__(self, config: uvicorn.Config, state: ServeState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        logger.info("received %s: finishing in-flight requests", signal.Signals(sig).name)
        self.state.scheduler.close()
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once shut down (the process would die of SIGTERM);
        # a shutdown that completed cleanly exits 0 instead.
        getattr(self, "_captured_signals", []).clear()


def run_server(state: ServeState, host: str = "127.0.0.1", port: int = 8000,
               shutdown_timeout: float = 30.0, log_level: str = "info") -> None:
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    GracefulServer(config, state).run()
