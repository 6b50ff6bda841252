"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

Names follow vLLM's with a `draftsman:` prefix, so dashboards and scripts written for vLLM read
them with one substitution. Speculation counters are the ones vLLM exports:

    tau (accept length)        = 1 + accepted_tokens / drafts
    acceptance at position i   = accepted_tokens_per_pos{position=i} / drafts
    per-draft-token acceptance = accepted_tokens / draft_tokens

A "draft" is one verification round of one request; its draft tokens are the verified tree's
nodes except the root (`--spec-draft-tokens - 1`); position i (0-based) counts rounds that
accepted at least i + 1 drafted tokens, so the positions add up to accepted_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

PREFIX = "draftsman:"
# Seconds; fine at the low end where a tiny or well-batched model lives.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServeMetrics:
    """Every metric the server exports; each carries a `model_name` label as vLLM's do."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `*_created` series: they double the output for nothing
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        m, r = ["model_name"], self.registry
        self.requests = Counter(PREFIX + "requests", "HTTP requests to the generation endpoints, "
                                "by endpoint, status code and finish reason",
                                [*m, "endpoint", "status", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", m, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from admission to the "
                              "queue until the first generated token", m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between generated tokens "
                             "(a round emitting k tokens counts k intervals of 1/k its duration)",
                             m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from admission to the "
                             "queue until the last token", m, buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a batch slot", m, registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Rows per decoding round (one target forward)",
                                    m, buckets=BATCH_BUCKETS, registry=r)
        self.drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative verification rounds, "
                              "summed over requests", m, registry=r)
        self.draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Drafted tokens verified "
                                    "(tree nodes except the root)", m, registry=r)
        self.accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Drafted tokens "
                                       "accepted", m, registry=r)
        self.plain_rounds = Counter(PREFIX + "spec_decode_num_plain_rounds", "Rounds that decoded a request "
                                    "plainly in a speculative server (adaptive speculation), summed over requests",
                                    m, registry=r)
        self.accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Rounds "
                                        "that accepted a drafted token at this depth (0-based)",
                                        [*m, "position"], registry=r)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e,
                       self.running, self.waiting, self.batch_size):
            metric.labels(model_name)  # exported (at 0) before the first request

    def request_done(self, endpoint: str, status: int, finish_reason: str | None) -> None:
        self.requests.labels(self.model_name, endpoint, str(status), finish_reason or "none").inc()

    def count_rounds(self, hist_delta: Sequence[int], draft_tokens: int, plain_rounds: int = 0) -> None:
        """Add rounds given as a histogram delta (index = drafted tokens accepted in the round)
        and the draft tokens they verified, and plain rounds."""
        if plain_rounds:
            self.plain_rounds.labels(self.model_name).inc(plain_rounds)
        rounds = sum(hist_delta)
        if rounds == 0:
            return
        name = self.model_name
        self.drafts.labels(name).inc(rounds)
        self.draft_tokens.labels(name).inc(draft_tokens)
        self.accepted_tokens.labels(name).inc(sum(i * h for i, h in enumerate(hist_delta)))
        for pos in range(len(hist_delta) - 1):
            reached = sum(hist_delta[pos + 1:])
            if reached:
                self.accepted_per_pos.labels(name, str(pos)).inc(reached)

    def init_positions(self, depth: int) -> None:
        """Export every position from the start (at 0), so a scrape before traffic shows them."""
        for c in (self.drafts, self.draft_tokens, self.accepted_tokens, self.plain_rounds):
            c.labels(self.model_name)
        for pos in range(depth):
            self.accepted_per_pos.labels(self.model_name, str(pos))

    def render(self) -> bytes:
        return generate_latest(self.registry)
