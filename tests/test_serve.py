"""`draftsman serve` against live servers on 127.0.0.1 (uvicorn in a thread, or a subprocess).

Servers: plain decoding, speculative with a saved (random) EAGLE-3 drafter, and speculative with
a bigram drafter that gets real acceptance (so the speculation counters are not all zero).
References come from `draftsman generate` run in-process through its CLI entry point.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from test_cli_generate import make_tokenizer
from test_engine import BigramDrafter

from draftsman.cli import main as cli_main
from draftsman.generate import StopRules, generate_plain
from draftsman.models import load_target
from draftsman.models.eagle3 import init_drafter, save_drafter
from draftsman.serve import build_state, create_app, load_state
from draftsman.session import PlainSession
from draftsman.spec.engine import SpecConfig
from draftsman.tokenizer import load_tokenizer

SPEC = SpecConfig(steps=3, topk=2, draft_tokens=6)
SPEC_ARGS = ["--spec-steps", "3", "--spec-topk", "2", "--spec-draft-tokens", "6"]
MAX_LEN = 128
EOS = frozenset({2})


# ---- live servers --------------------------------------------------------------------------------
class LiveServer:
    """uvicorn serving an app on a socket bound here (no port race), in a daemon thread."""

    def __init__(self, state) -> None:
        self.state = state
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(state), log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def name(self) -> str:
        return self.state.model_name

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=60, **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.post(self.url + path, content=body, timeout=60,
                              headers={"content-type": "application/json"}, **kw)
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def dirs(tiny_llama_dir, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    target = shutil.copytree(tiny_llama_dir, root / "tiny")
    make_tokenizer(target)
    drafter = save_drafter(init_drafter(load_target(target), seed=1), root / "drafter")
    return target, drafter


@pytest.fixture(scope="module")
def model(dirs):
    return load_target(dirs[0])


@pytest.fixture(scope="module")
def plain(dirs):
    with LiveServer(load_state(dirs[0], max_model_len=MAX_LEN, max_batch_size=16)) as s:
        yield s


@pytest.fixture(scope="module")
def spec(dirs):
    with LiveServer(load_state(dirs[0], dirs[1], SPEC, max_model_len=MAX_LEN, max_batch_size=16)) as s:
        yield s


@pytest.fixture(scope="module")
def adaptive(dirs, model):
    """Speculation with the bigram drafter only where it measures faster than plain steps."""
    state = build_state(model, load_tokenizer(dirs[0]), EOS, BigramDrafter(model), SPEC,
                        max_model_len=MAX_LEN, max_batch_size=16, model_name="adaptive", adaptive=True)
    with LiveServer(state) as s:
        yield s


@pytest.fixture(scope="module")
def bigram(dirs, model):
    state = build_state(model, load_tokenizer(dirs[0]), EOS, BigramDrafter(model), SPEC,
                        max_model_len=MAX_LEN, max_batch_size=16, model_name="bigram")
    with LiveServer(state) as s:
        yield s


def generate_ref(capsys, *args: str) -> dict:
    """`draftsman generate ... --json` through the CLI entry point (in-process: no start-up cost)."""
    capsys.readouterr()
    assert cli_main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- the OpenAI client, and equality with `draftsman generate` ------------------------------------
@pytest.mark.parametrize("kind", ["plain", "spec", "bigram", "adaptive"])
def test_openai_client_matches_generate(kind, request, dirs, capsys):
    server: LiveServer = request.getfixturevalue(kind)
    client = server.client()
    extra = ["--drafter", str(dirs[1]), *SPEC_ARGS] if kind == "spec" else []  # bigram, adaptive: plain reference
    for chat in (False, True):
        ref = generate_ref(capsys, "--target", str(dirs[0]), "--prompt", "hello world", "--max-new-tokens",
                           "12", *(["--chat"] if chat else []), *extra)
        kw = dict(model=server.name, max_tokens=12, temperature=0)
        if chat:
            kw["messages"] = [{"role": "user", "content": "hello world"}]
        else:
            kw["prompt"] = "hello world"
        create = client.chat.completions.create if chat else client.completions.create
        whole = create(**kw)
        choice = whole.choices[0]
        text = choice.message.content if chat else choice.text
        assert choice.model_extra["token_ids"] == ref["token_ids"]
        assert text == ref["text"]
        assert choice.finish_reason == ref["finish_reasons"][0]
        assert whole.usage.completion_tokens == len(ref["token_ids"])
        assert ("spec_decoding" in whole.model_extra) == (kind != "plain")

        chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
        parts = [c.choices[0] for c in chunks if c.choices]
        streamed = "".join((p.delta.content or "") if chat else p.text for p in parts)
        assert streamed == text
        assert [t for p in parts for t in p.model_extra["token_ids"]] == ref["token_ids"]
        assert parts[-1].finish_reason == choice.finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        if kind not in ("plain", "adaptive"):  # adaptive: the policy may pick other rounds this time
            assert chunks[-1].model_extra["spec_decoding"] == whole.model_extra["spec_decoding"]


def test_models_health_and_openapi(plain):
    models = plain.client().models.list()
    assert [m.id for m in models.data] == [plain.name]
    assert httpx.get(plain.url + "/health").json() == {"status": "ok"}
    schema = httpx.get(plain.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_token_id_prompt_and_stop_string(plain, model):
    ref = generate_plain(model, [[5, 6, 7]], StopRules(10, EOS)).token_ids[0]
    r = plain.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0}).json()
    assert r["choices"][0]["token_ids"] == ref
    words = r["choices"][0]["text"].split()
    stop = words[2]  # stop at the third word: the text before it comes back, without it
    r2 = plain.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0,
                                        "stop": [stop]}).json()
    assert r2["choices"][0]["finish_reason"] == "stop"
    assert r2["choices"][0]["text"] == r["choices"][0]["text"][: r["choices"][0]["text"].index(stop)]
    lines = stream_lines(plain, {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "stop": stop,
                                 "stream": True})
    assert "".join(json.loads(x)["choices"][0]["text"] for x in lines[:-1]) == r2["choices"][0]["text"]


def stream_lines(server: LiveServer, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return lines


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_seed_is_reproducible_and_matches_generate(kind, request, dirs, capsys):
    server: LiveServer = request.getfixturevalue(kind)
    extra = ["--drafter", str(dirs[1]), *SPEC_ARGS] if kind == "spec" else []
    ref = generate_ref(capsys, "--target", str(dirs[0]), "--prompt", "how are you", "--max-new-tokens", "10",
                       "--temperature", "1.0", "--seed", "7", *extra)
    body = {"prompt": "how are you", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    outs = [server.post("/v1/completions", body).json()["choices"][0]["token_ids"] for _ in range(2)]
    assert outs[0] == outs[1] == ref["token_ids"]


# ---- continuous batching -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["plain", "bigram"])
def test_sixteen_concurrent_streams_are_batched(kind, request, model, dirs):
    server: LiveServer = request.getfixturevalue(kind)
    tok = load_tokenizer(dirs[0])
    prompts = [" ".join(["hello", "world", "how", "are", "you"][: 1 + i % 5] + [f"w{20 + i}"] * (i % 3))
               for i in range(16)]
    lengths = [8 + (i * 5) % 17 for i in range(16)]  # short and long requests together
    expected = [generate_plain(model, [tok.encode(p)], StopRules(n, EOS)).token_ids[0]
                for p, n in zip(prompts, lengths, strict=True)]
    before = server.metrics()

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> list[int]:
        ids: list[int] = []
        stream = await client.completions.create(model=server.name, prompt=prompt, max_tokens=n,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
        return ids

    async def all_of() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths, strict=True)))

    assert asyncio.run(all_of()) == expected
    after = server.metrics()
    count = metric(after, "draftsman:batch_size_count") - metric(before, "draftsman:batch_size_count")
    single = (metric(after, "draftsman:batch_size_bucket", le="1.0")
              - metric(before, "draftsman:batch_size_bucket", le="1.0"))
    assert count > single, "every round ran a single row: the requests were not batched"
    wait_for(lambda: metric(server.metrics(), "draftsman:num_requests_running") == 0)


def test_a_long_request_does_not_block_a_short_one(plain, slow_rounds):
    """The short request joins the running batch and finishes while the long one still runs."""
    long_done = threading.Event()

    def long_request() -> None:
        body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", plain.url + C, json=body, timeout=60) as r:
            for _ in r.iter_lines():
                pass
        long_done.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    wait_for(lambda: metric(plain.metrics(), "draftsman:num_requests_running") == 1)
    short = plain.post(C, {"prompt": "how are you", "max_tokens": 3, "temperature": 0})
    assert short.status_code == 200 and len(short.json()["choices"][0]["token_ids"]) == 3
    assert not long_done.is_set()
    worker.join(60)
    assert long_done.is_set()


def test_coalesced_joins_serve_every_request_as_before(dirs, model, monkeypatch):
    """With a join's fixed part made large (every freed slot worth holding for the next), the
    server's freed slots wait to be refilled together, at most --join-wait-rounds rounds: fewer
    joins than with 0 (at once), and every request still gets its plain-decoding answer."""
    from draftsman.joins import JoinCoalescer

    monkeypatch.setattr(JoinCoalescer, "fixed_seconds", lambda self: 1.0)
    prompts, lengths = [[5 + i, 6, 7 + i % 3] for i in range(12)], [3 + (i * 7) % 11 for i in range(12)]
    expected = [generate_plain(model, [p], StopRules(n, EOS)).token_ids[0] for p, n in zip(prompts, lengths, strict=True)]
    joins = {}
    for wait in (0, 8):
        state = build_state(model, load_tokenizer(dirs[0]), EOS, max_model_len=MAX_LEN, max_batch_size=4,
                            model_name="coalesced", join_wait_rounds=wait)
        shared, joins[wait] = state.scheduler._shared, []
        add = shared.add
        monkeypatch.setattr(shared, "add", lambda requests, _add=add, _j=joins[wait]: _j.append(len(requests)) or _add(requests))
        with LiveServer(state) as server:
            async def all_of(url=server.url):
                async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                    return await asyncio.gather(*(c.post(C, json={"prompt": p, "max_tokens": n, "temperature": 0})
                                                  for p, n in zip(prompts, lengths, strict=True)))

            outs = [r.json()["choices"][0]["token_ids"] for r in asyncio.run(all_of())]
        assert outs == expected and sum(joins[wait]) == 12
    assert len(joins[8]) < len(joins[0])
    with pytest.raises(ValueError, match="join_wait_rounds"):
        build_state(model, load_tokenizer(dirs[0]), EOS, max_model_len=MAX_LEN, join_wait_rounds=-1)


def test_max_batch_size_caps_the_running_batch(dirs, model, slow_rounds):
    state = build_state(model, load_tokenizer(dirs[0]), EOS, max_model_len=MAX_LEN, max_batch_size=2,
                        model_name="capped")
    with LiveServer(state) as server:
        async def five():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                return await asyncio.gather(*(c.post(C, json={"prompt": [5 + i, 6], "max_tokens": 6,
                                                              "temperature": 0}) for i in range(5)))

        peak_waiting = 0

        def watch() -> None:
            nonlocal peak_waiting
            while not done.is_set():
                peak_waiting = max(peak_waiting, metric(server.metrics(), "draftsman:num_requests_waiting"))
                time.sleep(0.02)

        done = threading.Event()
        watcher = threading.Thread(target=watch)
        watcher.start()
        responses = asyncio.run(five())
        done.set()
        watcher.join()
        assert all(len(r.json()["choices"][0]["token_ids"]) == 6 for r in responses)
        samples = server.metrics()
        assert metric(samples, "draftsman:batch_size_bucket", le="2.0") == metric(samples, "draftsman:batch_size_count")
        assert metric(samples, "draftsman:batch_size_sum") > metric(samples, "draftsman:batch_size_count")
        assert peak_waiting >= 1


# ---- bad input never hurts the server ------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hello"}]
BAD_INPUTS = [
    (C, b'{"prompt": "hello",', 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "hello", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": 2.5}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": -3}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hello", "max_tokens": 10**30}, 400, "max_tokens"),
    (C, {"prompt": "hello " * 200}, 400, "prompt"),
    (C, {"prompt": [1, 2, 99999]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["hello", "world"]}, 400, "prompt"),
    (C, {"prompt": "hello", "model": "gpt-4"}, 404, "model"),
    (C, {"prompt": "hello", "n": 2}, 400, "n"),
    (C, {"prompt": "hello", "logprobs": 1}, 400, "logprobs"),
    (C, {"prompt": "hello", "echo": True}, 400, "echo"),
    (C, {"prompt": "hello", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "hello", "presence_penalty": 0.5}, 400, "presence_penalty"),
    (C, {"prompt": "hello", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hello", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hello", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hello", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hello", "stop": ""}, 400, "stop"),
    (C, {"prompt": "hello", "stop": ["a"] * 17}, 400, "stop"),
    (C, {"prompt": "hello", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hello", "frobnicate": 1}, 400, "frobnicate"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
     "messages"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
    (CHAT, {"messages": HI, "logprobs": True}, 400, "logprobs"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": HI, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 200}]}, 400, "messages"),
    (CHAT, {"messages": HI, "model": "nope", "stream": True}, 404, "model"),
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(plain):
    before = plain.metrics()
    for path, body, status, param in BAD_INPUTS:
        r = plain.post(path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        assert err["param"] == param, (body, err)
    for method, path, status in [("GET", "/v1/nothing", 404), ("GET", C, 405)]:
        r = httpx.request(method, plain.url + path)
        assert r.status_code == status and r.json()["error"]["message"]
    after = plain.metrics()
    rejected = sum(metric(after, "draftsman:requests_total", status=s) - metric(before, "draftsman:requests_total",
                                                                                  status=s)
                   for s in ("400", "404"))
    assert rejected == len(BAD_INPUTS)
    ok = plain.post(C, {"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3


def test_openai_client_raises_on_bad_requests(plain):
    client = plain.client()
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.completions.create(model=plain.name, prompt="hello", n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hello")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=plain.name, messages=HI, max_tokens=10**6)


# ---- disconnects and failures --------------------------------------------------------------------
@pytest.fixture
def slow_rounds(monkeypatch):
    """Make every plain round take >= 20 ms, so a 100-token request outlives a quick disconnect."""
    original = PlainSession._round

    def slow(self):
        time.sleep(0.02)
        return original(self)

    monkeypatch.setattr(PlainSession, "_round", slow)


def freed(server: LiveServer, before: dict) -> bool:
    """One more request counted as closed by its client, and nothing left running."""
    now = server.metrics()
    closed = (metric(now, "draftsman:requests_total", status="499", finish_reason="cancelled")
              - metric(before, "draftsman:requests_total", status="499", finish_reason="cancelled"))
    return closed == 1 and metric(now, "draftsman:num_requests_running") == 0


def test_disconnect_mid_stream_frees_the_slot(plain, slow_rounds):
    before = plain.metrics()
    body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", plain.url + C, json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["token_ids"]
    # closing the response closed the connection; the request must leave the batch early
    wait_for(lambda: freed(plain, before))
    after = plain.metrics()
    generated = metric(after, "draftsman:generation_tokens_total") - metric(before, "draftsman:generation_tokens_total")
    assert generated < 100


def test_disconnect_while_waiting_for_a_whole_response(plain, slow_rounds):
    before = plain.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(plain.url + C, json={"prompt": "hello", "max_tokens": 100, "temperature": 0}, timeout=0.5)
    wait_for(lambda: freed(plain, before))


def test_internal_error_fails_only_that_request(plain, monkeypatch):
    """A prompt containing token 250 makes prefill raise; a request admitted with it is unaffected."""
    original = PlainSession._prefill

    def faulty(self, ids, lengths, sampling, rows):
        if bool((ids == 250).any()):
            raise RuntimeError("injected prefill fault")
        return original(self, ids, lengths, sampling, rows)

    monkeypatch.setattr(PlainSession, "_prefill", faulty)
    good = {"prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0}
    bad = {"prompt": [5, 250, 7], "max_tokens": 20, "temperature": 0}

    async def both():
        async with httpx.AsyncClient(base_url=plain.url, timeout=60) as c:
            return await asyncio.gather(c.post(C, json=bad), c.post(C, json=good), c.post(C, json=bad | {"stream": True}))

    r_bad, r_good, r_bad_stream = asyncio.run(both())
    assert r_bad.status_code == 500 and "injected prefill fault" in r_bad.json()["error"]["message"]
    assert r_bad_stream.status_code == 500 and r_bad_stream.json()["error"]["type"] == "internal_error"
    assert r_good.status_code == 200 and len(r_good.json()["choices"][0]["token_ids"]) == 20

    # A round that raises fails the rows of that round; the next request is served by a fresh batch.
    calls = {"n": 0}
    round_ = PlainSession._round

    def fails_once(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected round fault")
        return round_(self)

    monkeypatch.setattr(PlainSession, "_round", fails_once)
    r = plain.post(C, good)
    assert r.status_code == 500 and "injected round fault" in r.json()["error"]["message"]
    assert plain.post(C, good).json()["choices"][0]["token_ids"] == r_good.json()["choices"][0]["token_ids"]
    assert httpx.get(plain.url + "/health").status_code == 200


# ---- API key -------------------------------------------------------------------------------------
def test_api_key(dirs):
    state = load_state(dirs[0], max_model_len=64, api_key="sekrit")
    with LiveServer(state) as s:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = s.post(C, {"prompt": "hello", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=s.name, prompt="hello", max_tokens=2)
        r = s.client(api_key="sekrit").completions.create(model=s.name, prompt="hello", max_tokens=2)
        assert len(r.choices[0].model_extra["token_ids"]) == 2
        assert httpx.get(s.url + "/health").status_code == 200  # probes and scrapes need no key
        samples = s.metrics()
        assert metric(samples, "draftsman:requests_total", status="401") == 4  # 3 + the client's


# ---- metrics add up ------------------------------------------------------------------------------
def test_metrics_add_up_to_the_responses(bigram):
    client = bigram.client()
    before = bigram.metrics()
    usages, specs = [], []
    for prompt in ("hello world", "how are you", "w5 w6 w7 w8"):
        r = client.completions.create(model=bigram.name, prompt=prompt, max_tokens=24, temperature=0)
        usages.append(r.usage)
        specs.append(r.model_extra["spec_decoding"])
    r = client.chat.completions.create(model=bigram.name, messages=HI, max_tokens=20, temperature=0)
    usages.append(r.usage)
    specs.append(r.model_extra["spec_decoding"])
    for chat in (False, True):
        kw = dict(model=bigram.name, max_tokens=16, temperature=0.8, stream=True,
                  stream_options={"include_usage": True})
        stream = client.chat.completions.create(messages=HI, **kw) if chat else \
            client.completions.create(prompt="are you", **kw)
        last = list(stream)[-1]
        usages.append(last.usage)
        specs.append(last.model_extra["spec_decoding"])
    after = bigram.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("draftsman:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("draftsman:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("draftsman:requests_total", endpoint=C, status="200") == 4
    assert delta("draftsman:requests_total", endpoint=CHAT, status="200") == 2
    assert delta("draftsman:time_to_first_token_seconds_count") == len(usages)
    assert delta("draftsman:e2e_request_latency_seconds_count") == len(usages)
    assert delta("draftsman:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    drafts = delta("draftsman:spec_decode_num_drafts_total")
    accepted = delta("draftsman:spec_decode_num_accepted_tokens_total")
    assert drafts == sum(s["rounds"] for s in specs)
    assert delta("draftsman:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in specs) \
        == drafts * (SPEC.draft_tokens - 1)
    assert accepted == sum(s["accepted_tokens"] for s in specs) > 0, "the bigram drafter accepted nothing"
    per_pos = [delta("draftsman:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(SPEC.steps)]
    assert sum(per_pos) == accepted
    for i, count in enumerate(per_pos):
        assert count == pytest.approx(sum(s["accept_rate_per_position"][i] * s["rounds"] for s in specs), abs=0.01)
    # tau from the counters, as a dashboard computes it, equals the rounds-weighted per-request tau
    tau = 1 + accepted / drafts
    assert tau == pytest.approx(sum(s["accept_length"] * s["rounds"] for s in specs) / drafts, abs=1e-3)
    # each request's tokens: one from prefill, then accept_length per round
    for u, s in zip(usages, specs, strict=True):
        assert u.completion_tokens <= 1 + s["rounds"] + s["accepted_tokens"]
    assert metric(after, "draftsman:num_requests_running") == 0
    assert metric(after, "draftsman:num_requests_waiting") == 0


def test_adaptive_server_counts_only_speculative_rounds(adaptive):
    """Plain steps (the policy measures them first) are not speculation rounds: the counters and
    each response's spec_decoding cover only the rounds that drafted, so tokens from plain steps
    come on top of 1 + rounds + accepted."""
    client = adaptive.client()
    before = adaptive.metrics()
    rs = [client.completions.create(model=adaptive.name, prompt=p, max_tokens=24, temperature=0)
          for p in ("hello world", "how are you", "w5 w6 w7 w8")]
    specs = [r.model_extra["spec_decoding"] for r in rs]
    after = adaptive.metrics()

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    rounds = sum(s["rounds"] for s in specs)
    assert delta("draftsman:spec_decode_num_drafts_total") == rounds > 0
    assert delta("draftsman:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in specs) \
        == rounds * (SPEC.draft_tokens - 1)
    plain_tokens = sum(r.usage.completion_tokens - 1 - s["rounds"] - s["accepted_tokens"] for r, s in zip(rs, specs,
                                                                                                       strict=True))
    assert plain_tokens > 0
    # the plain rounds are reported per request and counted in the metrics; every round keeps at
    # least one token (the last may be cut at max_tokens)
    assert delta("draftsman:spec_decode_num_plain_rounds_total") == sum(s["plain_rounds"] for s in specs) > 0
    for r, s in zip(rs, specs, strict=True):
        rounds = 1 + s["rounds"] + s["plain_rounds"]
        assert rounds <= r.usage.completion_tokens <= rounds + s["accepted_tokens"]


# ---- the command line: a subprocess server, SIGTERM -----------------------------------------------
def test_cli_serve_subprocess_and_sigterm(dirs, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "draftsman.cli", "serve", "--target", str(dirs[0]),
                             "--drafter", str(dirs[1]), *SPEC_ARGS, "--port", str(port), "--max-model-len",
                             str(MAX_LEN), "--served-model-name", "tiny-spec"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny-spec"
        assert models["data"][0]["max_model_len"] == MAX_LEN
        # SIGTERM while a stream is in flight: it still completes, then the process exits 0.
        body = {"prompt": "hello", "max_tokens": 120, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + C, json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(60) == 0, (tmp_path / "server.log").read_text()
        logged = (tmp_path / "server.log").read_text()
        assert "received SIGTERM" in logged and "Waiting for connections to close" in logged, logged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_scheduler_thread_computes_with_the_threads_it_is_given(dirs, model, monkeypatch):
    """build_state(threads=N): decoding rounds run with N intra-op threads, whatever the loading
    thread keeps (draftsman serve leaves it one on CPU: commands/serve.py says why)."""
    seen = []
    step = PlainSession.step
    monkeypatch.setattr(PlainSession, "step", lambda self: seen.append(torch.get_num_threads()) or step(self))
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    state = build_state(model, load_tokenizer(dirs[0]), EOS, max_model_len=MAX_LEN, model_name="threads",
                        threads=want)
    with LiveServer(state) as server:
        r = httpx.post(server.url + C, json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and seen and set(seen) == {want}
    assert torch.get_num_threads() == before  # (this thread's own setting is untouched)
