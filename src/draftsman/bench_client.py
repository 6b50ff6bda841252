"""`draftsman bench --server-url`: benchmark any OpenAI-compatible server (draftsman serve, SGLang,
vLLM) with concurrent streaming requests.

Each request streams from /v1/chat/completions (the server applies the model's chat template)
or, with --no-chat, /v1/completions. Tokens are counted from the final chunk's `usage`
(`stream_options.include_usage`), the same way for the served arm and the baseline; a server
that sends no usage is counted by content chunks, with a note. Acceptance comes from each
response's `spec_decoding` field (draftsman serve), else from the deltas of the
`draftsman:`/`vllm:` `spec_decode_*` counters on /metrics around the run, else it is null.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from draftsman.bench import (
    NO_ACCEPTANCE,
    Trace,
    acceptance_from_counters,
    acceptance_from_responses,
    count_reasons,
    latency_summary,
    spec_counters,
    with_defaults,
)


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClientConfig:
    """How to reach one server and what to ask it."""

    base_url: str  # scheme://host:port, without /v1
    model: str
    chat: bool = True
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def endpoint(self) -> str:
        return f"{self.base_url}/v1/{'chat/completions' if self.chat else 'completions'}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000' (endpoints are appended to it)."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def request_body(cfg: ClientConfig, prompt: str) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                  "top_p": cfg.top_p, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.top_k:
        body["top_k"] = cfg.top_k  # a vLLM / SGLang extension
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    return body


def chunk_text(chunk: dict) -> str:
    """The new text of one streamed chunk (chat delta content or completion text)."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            parts.append(text)
    return "".join(parts)


def apply_chunk(trace: Trace, chunk: dict, now: float, texts: list[str]) -> None:
    """Fold one streamed chunk into the request's trace."""
    if "error" in chunk:
        raise ServerError(f"server error in stream: {chunk['error']}")
    text = chunk_text(chunk)
    if text:
        trace.deliveries.append(now)
        texts.append(text)
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
        if isinstance(choice.get("spec_decoding"), dict):
            trace.spec_decoding = choice["spec_decoding"]
    if isinstance(chunk.get("spec_decoding"), dict):
        trace.spec_decoding = chunk["spec_decoding"]
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        trace.num_tokens = int(usage["completion_tokens"])
        trace.counted_by_usage = True


async def stream_one(client: httpx.AsyncClient, cfg: ClientConfig, prompt: str,
                     clock: Callable[[], float] = time.perf_counter) -> Trace:
    trace = Trace(start=clock())
    texts: list[str] = []
    async with client.stream("POST", cfg.endpoint, json=request_body(cfg, prompt), headers=cfg.headers) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:500]
            raise ServerError(f"POST {cfg.endpoint}: HTTP {resp.status_code}: {body}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            apply_chunk(trace, json.loads(data), clock(), texts)
    trace.output = "".join(texts)
    if not trace.counted_by_usage:
        trace.counted_by_usage = False
        trace.num_tokens = len(trace.deliveries)  # best effort: one token per content chunk
    return trace


async def run_concurrent(cfg: ClientConfig, prompts: Sequence[str], concurrency: int,
                         on_finish: Callable[[], None] | None = None) -> tuple[list[Trace], float]:
    """Send every prompt with at most `concurrency` in flight; (traces in prompt order, seconds)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s), limits=limits) as client:

        async def one(prompt: str) -> Trace:
            async with gate:
                trace = await stream_one(client, cfg, prompt)
            if on_finish:
                on_finish()
            return trace

        start = time.perf_counter()
        traces = await asyncio.gather(*(one(p) for p in prompts))
        return list(traces), time.perf_counter() - start


def fetch_metrics(url: str, api_key: str | None = None) -> str | None:
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model id of GET /v1/models (what --model defaults to)."""
    try:
        resp = httpx.get(f"{url}/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ServerError(f"{url}/v1/models: cannot find the served model ({e}); pass --model") from None


def bench_server(cfg: ClientConfig, prompts: Sequence[str], concurrencies: Sequence[int], *,
                 baseline: ClientConfig | None = None, warmup: int = 0, repeats: int = 1,
                 on_finish: Callable[[], None] | None = None) -> tuple[list[dict], list[str]]:
    """The served configuration (and a plain baseline server) at each concurrency. With repeats
    > 1 each server runs the prompts that many times, the runs going round the servers (each
    round starting one further on), and reports its run of median duration (`durations_s`:
    all of them), so a noisy machine's drift falls on both alike. Returns (arm dicts, notes)."""
    arms: list[dict] = []
    notes: list[str] = []
    greedy = cfg.temperature == 0
    for c in concurrencies:
        runs = [("server", "served", cfg)] + ([("baseline", "plain", baseline)] if baseline else [])
        if warmup:
            for _, _, server in runs:
                asyncio.run(run_concurrent(server, prompts[:warmup], c))
        timed: dict[str, list[tuple[float, list[Trace], str | None, str | None]]] = {name: [] for name, _, _ in runs}
        for rep in range(repeats):
            for name, _, server in runs[rep % len(runs):] + runs[: rep % len(runs)]:
                before = fetch_metrics(server.base_url, server.api_key)
                traces, duration = asyncio.run(run_concurrent(server, prompts, c, on_finish))
                timed[name].append((duration, traces, before, fetch_metrics(server.base_url, server.api_key)))
        results = {}
        for name, kind, server in runs:
            duration, traces, before, after = sorted(timed[name], key=lambda r: r[0])[(len(timed[name]) - 1) // 2]
            arm = {"arm": name, "kind": kind, "spec": None, "batch_size": c, "url": server.base_url,
                   **latency_summary(traces, duration), "durations_s": [round(r[0], 6) for r in timed[name]]}
            arm |= acceptance_for(traces, before, after, kind, notes)
            arm["finish_reasons"] = count_reasons(traces)
            if not all(t.counted_by_usage for t in traces):
                _note(notes, f"{name}: the server sent no usage in its stream; tokens counted as content chunks")
            results[name] = [t.output for t in traces]
            arms.append(with_defaults(arm))
        if "baseline" in results and greedy:
            mismatched = sum(a != b for a, b in zip(results["server"], results["baseline"], strict=True))
            arm = next(a for a in arms if a["arm"] == "server" and a["batch_size"] == c)
            arm["identical"], arm["mismatched_requests"] = mismatched == 0, mismatched
    return arms, notes


def acceptance_for(traces: Sequence[Trace], before: str | None, after: str | None, kind: str,
                   notes: list[str]) -> dict:
    """Per-response fields first, then /metrics counter deltas, else nulls and a note."""
    acc = acceptance_from_responses([t.spec_decoding for t in traces])
    if acc is not None:
        return NO_ACCEPTANCE | acc | {"acceptance_source": "response"}
    counters_after = spec_counters(after) if after else None
    acc = acceptance_from_counters(spec_counters(before) if before else None, counters_after)
    if acc is not None:
        return NO_ACCEPTANCE | acc | {"acceptance_source": f"metrics ({counters_after['source']}_*)"}
    if kind == "served":
        _note(notes, "no acceptance data from the server: no spec_decoding field in responses and no "
                     "draftsman:/vllm: spec_decode_* counters moved on /metrics (speculation off, or "
                     "another engine: read its own logs)")
    return dict(NO_ACCEPTANCE) | {"acceptance_source": None}


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
