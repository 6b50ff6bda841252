"""Have the target write the answers of a conversation corpus (self-distillation data for drafters).

Examples:
  draftsman prepare-data --target DIR --input sharegpt.jsonl.gz --output regen.jsonl
  draftsman prepare-data --target DIR --input prompts.jsonl --output regen.jsonl \\
      --drafter DRAFTER_DIR --spec-steps 5 --spec-topk 1      # speculative: same output, faster
  draftsman prepare-data --server-url http://host:30000 --input sharegpt.jsonl.gz \\
      --output regen.jsonl --concurrency 64 [--target DIR]    # any OpenAI-compatible server

A drafter learns the distribution it is trained on, so it should be trained on the target's own
answers, not on another model's. Every record keeps its system and user turns; the target writes
an answer after every user turn, in order, each conditioned on its own earlier answers, through
its chat template (assistant turns of the input are dropped). Input: JSONL or JSONL.gz in any
layout `draftsman.train.data.read_records` reads (ShareGPT, OpenAI messages, prompt, turns,
GPTeacher, GSM8K). Output: JSONL, one line per record: {"id": ..., "messages": [...]}; a repeated
input id gets "#2", "#3", ... appended.

Resumable: the output is appended to, one fsync'ed line per finished record; a rerun of the same
command skips ids already written (and drops a torn last line), so an interrupt loses at most the
records in flight and never duplicates one. Prompts longer than the target's max positions are
skipped (a multi-turn record then ends at its last answer); counts are printed at the end.

Locally, records are decoded in batches of --batch-size with draftsman's engine (speculatively
with --drafter: lossless, so the output is the same). With --server-url, --concurrency records
are in flight at once; connection errors and 5xx/429 answers are retried with backoff, any other
4xx stops the run. --target is then optional: with it, prompts are length-checked locally.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from jinja2 import TemplateError

from draftsman.cli import add_device_args, resolve_device, resolve_dtype
from draftsman.commands.generate import add_spec_policy_arg
from draftsman.train.data import Message, read_records

HELP = "have the target write the answers of a prompt corpus (drafter training data)"

MAX_RETRIES = 5
BACKOFF_S = 0.5  # first retry delay; doubles each attempt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target: HF checkpoint directory, .gguf file or hub id (optional with --server-url)")
    p.add_argument("--input", required=True, help="prompt corpus, .jsonl or .jsonl.gz")
    p.add_argument("--output", required=True, help="output .jsonl (appended to; reruns resume)")
    p.add_argument("--num-samples", type=int, default=None, help="use only the first N input records")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens per answer (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--batch-size", type=int, default=64, help="local mode: prompts decoded together (default 64)")
    p.add_argument("--drafter", help="local mode: EAGLE-3 drafter directory, to decode speculatively")
    p.add_argument("--spec-steps", type=int, default=None, help="draft depth (with --drafter)")
    p.add_argument("--spec-topk", type=int, default=None, help="branching per draft step (with --drafter)")
    p.add_argument("--spec-draft-tokens", type=int, default=None, help="verified tree nodes incl. the root")
    add_spec_policy_arg(p)
    p.add_argument("--server-url", help="OpenAI-compatible server, e.g. http://localhost:30000")
    p.add_argument("--model", help="server mode: model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=16, help="server mode: requests in flight (default 16)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="server mode: seconds per request")
    add_device_args(p)
    p.add_argument("--device-map", help="spread the target's layers over devices as a pipeline: 'auto' "
                   "(all visible GPUs) or a list such as cuda:0,cuda:1")


# ---- records --------------------------------------------------------------------------------------
@dataclass
class Job:
    """One record: its system/user turns, and the answers the target has written so far."""

    id: str
    base: list[Message]  # system and user messages, in order
    answers: list[str] = field(default_factory=list)
    stopped: str | None = None  # why no further turn is answered: "too_long" | "template"
    tokens: int = 0  # answer tokens generated (for the progress bar)
    error: str = ""  # the template's complaint, when stopped == "template"

    @property
    def num_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.base)

    @property
    def done(self) -> bool:
        return self.stopped is not None or len(self.answers) == self.num_turns

    def context(self) -> list[Message]:
        """What the target sees to write the next answer: through the next user turn."""
        return cut_after(interleave(self.base, self.answers), "user", len(self.answers) + 1)

    def conversation(self) -> list[Message]:
        """The finished record: through the last answer."""
        return cut_after(interleave(self.base, self.answers), "assistant", len(self.answers))


def prompt_messages(messages: list[Message]) -> list[Message]:
    """System and user turns; the target will answer every user turn (leading, repeated and
    trailing assistant turns of the source all just disappear)."""
    return [m for m in messages if m["role"] != "assistant"]


def interleave(base: list[Message], answers: list[str]) -> list[Message]:
    """base with answers[j] placed right after the j-th user message."""
    out, users = [], 0
    for m in base:
        out.append(m)
        if m["role"] == "user":
            if users < len(answers):
                out.append({"role": "assistant", "content": answers[users]})
            users += 1
    return out


def cut_after(messages: list[Message], role: str, count: int) -> list[Message]:
    """messages up to and including the count-th message of `role` (all of them if fewer)."""
    seen = 0
    for i, m in enumerate(messages):
        seen += m["role"] == role
        if seen == count:
            return messages[: i + 1]
    return list(messages)


def unique_ids(records: Iterable[tuple[str, list[Message]]]) -> Iterator[tuple[str, list[Message]]]:
    """Make ids unique, deterministically (ShareGPT repeats some): the n-th repeat gets '#n'."""
    used: set[str] = set()
    for rid, messages in records:
        uid, n = rid, 1
        while uid in used:
            n += 1
            uid = f"{rid}#{n}"
        used.add(uid)
        yield uid, messages


def pending_jobs(path: str, num_samples: int | None, done: set[str], counts: Counter) -> Iterator[Job]:
    """Jobs for the input records not yet in the output (counting the others in `counts`)."""
    for rid, messages in islice(unique_ids(read_records(path)), num_samples):
        if rid in done:
            counts["already_done"] += 1
            continue
        base = prompt_messages(messages)
        if not any(m["role"] == "user" for m in base):
            counts["no_user_turn"] += 1
            continue
        yield Job(rid, base)


# ---- resumable output -----------------------------------------------------------------------------
class ResumableJsonl:
    """Append-only JSONL whose finished lines survive an interrupt (flush + fsync per record)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done_ids, torn = read_done_ids(self.path)
        if torn:
            print(f"{self.path}: dropped a torn last line ({torn} bytes) left by an interrupted run",
                  file=sys.stderr)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done_ids.add(record["id"])

    def close(self) -> None:
        self._f.close()


def read_done_ids(path: Path) -> tuple[set[str], int]:
    """Ids already written, and the size of a torn final line (cut from the file) or 0.

    Every line is written whole with its newline last, so only text after the last newline can
    be torn; a bad line before it means the file is not ours, and stops the run.
    """
    if not path.exists():
        return set(), 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    torn = len(data) - end
    if torn:
        with path.open("r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    ids = set()
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SystemExit(f"error: {path}:{lineno} is not a prepare-data record; "
                             "use a new --output or fix the file") from None
    return ids, torn


# ---- local decoding -------------------------------------------------------------------------------
class LocalBackend:
    """The target (and optional drafter) loaded here; answers a batch of conversations at once."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from draftsman.commands.generate import make_decoder, spec_policy_from_args
        from draftsman.generate import StopRules, generate_plain
        from draftsman.models import load_target
        from draftsman.sampling import SamplingParams
        from draftsman.tokenizer import eos_token_ids

        device = resolve_device(args.device)
        self.model = load_target(args.target, device=device, dtype=resolve_dtype(args.dtype, device),
                                 device_map=args.device_map)
        device = self.model.embed_tokens.weight.device  # the pipeline's home device with --device-map
        self.tokenizer = load_chat_tokenizer(args.target)
        self.max_positions = self.model.config.max_position_embeddings
        self.eos = frozenset(eos_token_ids(args.target, self.model.config.eos_token_ids, self.tokenizer))
        self.rules = StopRules(args.max_new_tokens, self.eos)
        if args.seed is not None:
            torch.manual_seed(args.seed)  # once: every batch then draws fresh numbers
        self.params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        self.decode = make_decoder(args, self.model, device)
        self.plain = lambda prompts, rules, params: generate_plain(self.model, prompts, rules, params)
        # Speculation caches hold a draft tree beyond the committed tokens: rows that close to the
        # window decode plainly (same output, losslessness) instead of overflowing the cache.
        spec, candidates = spec_policy_from_args(args) if args.drafter else (None, ())
        shapes = [spec] if spec else list(candidates)
        self.margin = max((s.draft_tokens + s.steps * s.topk + 2 for s in shapes), default=0)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return encode_chat(self.tokenizer, messages)

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Answer ids per prompt; an answer never runs past the target's max positions."""
        limit = self.max_positions - self.rules.max_new_tokens - self.margin
        fits = [i for i, p in enumerate(prompts) if len(p) <= limit]
        out: list[list[int]] = [[] for _ in prompts]
        if fits:
            done = self.decode([prompts[i] for i in fits], self.rules, self.params).token_ids
            for i, ids in zip(fits, done, strict=True):
                out[i] = ids
        # Rows near the window get their own budget, decoded alone so that no row's answer depends
        # on which other rows share its batch (rare: prompts within max_new_tokens of the window).
        for i, p in enumerate(prompts):
            if len(p) > limit:
                budget = min(self.rules.max_new_tokens, self.max_positions - len(p))
                rules = dataclasses.replace(self.rules, max_new_tokens=budget)
                out[i] = self.plain([p], rules, self.params).token_ids[0]
        return out

    def answer_text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.eos:  # the end-of-turn token: the template writes it back
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def load_chat_tokenizer(target: str):
    from draftsman.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: {target} has no tokenizer with a chat template; prepare-data renders "
                         "conversations with the target's chat template")
    return tokenizer


def encode_chat(tokenizer, messages: list[Message]) -> list[int]:
    """The prompt ids for the next assistant turn (as `generate --chat` encodes a prompt)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run_local(jobs: Iterator[Job], backend: LocalBackend, batch_size: int,
              finish: Callable[[Job], None]) -> None:
    """Decode turns in batches; a record's next turn joins the next batch, new records fill it."""
    ready: deque[Job] = deque()
    while True:
        ready.extend(islice(jobs, max(0, batch_size - len(ready))))
        if not ready:
            return
        batch, prompts = [], []
        for job in (ready.popleft() for _ in range(min(batch_size, len(ready)))):
            try:
                ids = backend.prompt_ids(job.context())
            except (TemplateError, ValueError) as e:  # e.g. a template that rejects a role order
                job.stopped, job.error = "template", str(e)
                finish(job)
                continue
            if len(ids) >= backend.max_positions:
                job.stopped = "too_long"
                finish(job)
                continue
            batch.append(job)
            prompts.append(ids)
        if not batch:
            continue
        for job, ids in zip(batch, backend.generate(prompts), strict=True):
            job.tokens += len(ids)
            job.answers.append(backend.answer_text(ids))
            if job.done:
                finish(job)
            else:
                ready.appendleft(job)  # continuing records first: bounds the work in flight


# ---- server decoding ------------------------------------------------------------------------------
class ServerError(RuntimeError):
    pass


class ServerBackend:
    """An OpenAI-compatible /v1/chat/completions endpoint."""

    def __init__(self, args: argparse.Namespace) -> None:
        import httpx

        self.url = args.server_url.rstrip("/").removesuffix("/v1")
        self.client = httpx.Client(timeout=args.request_timeout,
                                   limits=httpx.Limits(max_connections=args.concurrency))
        self.stop = threading.Event()  # set on a fatal error: workers stop between requests
        self.model = args.model or self._first_model()
        self.body = {"model": self.model, "max_tokens": args.max_new_tokens, "temperature": args.temperature}
        if args.top_p < 1.0:
            self.body["top_p"] = args.top_p
        if args.top_k > 0:
            self.body["top_k"] = args.top_k  # not OpenAI's, but SGLang and vLLM read it
        self.seed = args.seed
        self.tokenizer, self.max_positions = None, None
        if args.target:  # optional: lets prompts be length-checked before they are sent
            from draftsman.config import load_target_config

            self.tokenizer = load_chat_tokenizer(args.target)
            self.max_positions = load_target_config(args.target).max_position_embeddings

    def _first_model(self) -> str:
        data = self._request("GET", "/v1/models").get("data") or []
        if not data or "id" not in data[0]:
            raise ServerError(f"{self.url}/v1/models lists no model; pass --model")
        return data[0]["id"]

    def _request(self, method: str, route: str, body: dict | None = None) -> dict:
        """One call with retries: connection errors, 5xx and 429 back off and retry; other 4xx raise."""
        import httpx

        url = self.url + route
        for attempt in range(MAX_RETRIES + 1):
            if self.stop.is_set():
                raise ServerError("stopped")
            try:
                r = self.client.request(method, url, json=body)
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 400:
                    return r.json()
                problem = f"HTTP {r.status_code}: {r.text[:500]}"
                if r.status_code < 500 and r.status_code != 429:
                    raise ServerError(f"{method} {url} -> {problem}")
            if attempt < MAX_RETRIES:
                time.sleep(BACKOFF_S * 2**attempt)
        raise ServerError(f"{method} {url} failed {MAX_RETRIES + 1} times; last: {problem}")

    def chat(self, messages: list[Message], seed: int | None) -> tuple[str, int]:
        """(answer text, completion tokens as the server reports them, else 0)."""
        body = {**self.body, "messages": messages}
        if seed is not None:
            body["seed"] = seed
        reply = self._request("POST", "/v1/chat/completions", body)
        try:
            text = reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"unexpected chat completion: {json.dumps(reply)[:300]}") from None
        usage = reply.get("usage") or {}
        return text, int(usage.get("completion_tokens") or 0)

    def too_long(self, messages: list[Message]) -> bool:
        return self.tokenizer is not None and len(encode_chat(self.tokenizer, messages)) >= self.max_positions

    def answer(self, job: Job) -> Job:
        """All turns of one record, in order (each needs the previous answer)."""
        while not job.done:
            context = job.context()
            if self.too_long(context):
                job.stopped = "too_long"
                break
            text, tokens = self.chat(context, turn_seed(self.seed, job.id, len(job.answers)))
            job.answers.append(text)
            job.tokens += tokens
        return job


def turn_seed(seed: int | None, rid: str, turn: int) -> int | None:
    """A per-(record, turn) seed, so a resumed run samples what the first run would have."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}:{rid}:{turn}".encode()).digest()[:4], "little") >> 1


def run_server(jobs: Iterator[Job], backend: ServerBackend, concurrency: int,
               finish: Callable[[Job], None]) -> None:
    """Keep `concurrency` records in flight; write each as it completes."""
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="prepare-data")
    in_flight: set[Future] = set()
    try:
        while True:
            for job in islice(jobs, max(0, 2 * concurrency - len(in_flight))):
                in_flight.add(pool.submit(backend.answer, job))
            if not in_flight:
                return
            finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
            for fut in finished:
                finish(fut.result())
    finally:
        backend.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)


# ---- command --------------------------------------------------------------------------------------
def check_args(args: argparse.Namespace) -> None:
    if not args.server_url and not args.target:
        raise SystemExit("error: pass --target DIR (local decoding) or --server-url URL")
    if args.server_url and args.drafter:
        raise SystemExit("error: --drafter decodes locally; the server does its own speculation")
    for name in ("max_new_tokens", "batch_size", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.num_samples is not None and args.num_samples < 0:
        raise SystemExit("error: --num-samples must be >= 0")
    if not Path(args.input).exists():
        raise SystemExit(f"error: --input {args.input}: no such file")
    if Path(args.input).resolve() == Path(args.output).resolve():
        raise SystemExit("error: --output must differ from --input")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    check_args(args)
    out = ResumableJsonl(args.output)
    counts: Counter = Counter()
    try:
        todo = sum(1 for _ in pending_jobs(args.input, args.num_samples, out.done_ids, Counter()))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        backend = ServerBackend(args) if args.server_url else LocalBackend(args)
    except ServerError as e:
        raise SystemExit(f"error: {e}") from None
    bar = tqdm(total=todo, unit="rec", desc="prepare-data", file=sys.stderr, dynamic_ncols=True)
    start = time.perf_counter()
    first_error: list[str] = []

    def finish(job: Job) -> None:
        counts["answer_tokens"] += job.tokens
        if job.answers:
            out.write({"id": job.id, "messages": job.conversation()})
            counts["written"] += 1
        if job.stopped:
            counts[f"{'cut' if job.answers else 'skipped'}_{job.stopped}"] += 1
        if job.stopped == "template" and not first_error:
            first_error.append(f"record {job.id}: {job.error}")
        bar.update(1)
        if counts["answer_tokens"]:
            bar.set_postfix(tok_s=f"{counts['answer_tokens'] / (time.perf_counter() - start):.0f}", refresh=False)

    jobs = pending_jobs(args.input, args.num_samples, out.done_ids, counts)
    try:
        if isinstance(backend, ServerBackend):
            run_server(jobs, backend, args.concurrency, finish)
        else:
            run_local(jobs, backend, args.batch_size, finish)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {counts['written']} records written to {args.output}; rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    except ServerError as e:
        raise SystemExit(f"error: {e}\n{counts['written']} records written to {args.output}; rerun to resume") from None
    finally:
        bar.close()
        out.close()
    print(summary(counts, args.output, backend.max_positions, time.perf_counter() - start, first_error))
    return 0


def summary(counts: Counter, output: str, max_positions: int | None, elapsed: float,
            template_errors: list[str]) -> str:
    parts = [f"wrote {counts['written']} records to {output} in {elapsed:.1f} s "
             f"({counts['written'] / max(elapsed, 1e-9):.2f} records/s)"]
    if counts["already_done"]:
        parts.append(f"{counts['already_done']} were already there")
    if counts["skipped_too_long"] or counts["cut_too_long"]:
        parts.append(f"skipped {counts['skipped_too_long']} records whose prompt exceeds the target's "
                     f"{max_positions} positions; cut {counts['cut_too_long']} multi-turn "
                     "records short for the same reason")
    if counts["skipped_template"] or counts["cut_template"]:
        parts.append(f"skipped {counts['skipped_template']} records and cut {counts['cut_template']} short "
                     f"that the chat template rejects (first: {template_errors[0]})")
    if counts["no_user_turn"]:
        parts.append(f"skipped {counts['no_user_turn']} records without a user turn")
    return "; ".join(parts)
