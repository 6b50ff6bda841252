"""FastAPI application: OpenAI-compatible routes, validation and errors, streaming.

Handlers validate and tokenize in the event loop, hand a `Job` to the scheduler thread and read
its events from an asyncio queue. Every error a client can cause is an OpenAI-style 4xx body
naming the parameter; an engine failure on one request is a 500 for that request only. A client
that disconnects (streaming or not) has its request cancelled, which frees its batch slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Receive, Scope, Send

from draftsman.generate import StopRules
from draftsman.sampling import SamplingParams
from draftsman.serve.metrics import ServeMetrics
from draftsman.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
    SamplingRequest,
    check_request,
    error_body,
    requested_max_tokens,
    spec_decoding_fields,
)
from draftsman.serve.scheduler import Job, JobFailed, Scheduler, ShuttingDown
from draftsman.serve.text import TextStream, final_text
from draftsman.session import Event, Request
from draftsman.spec.verify import summarize_histogram

logger = logging.getLogger("draftsman.serve")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GENERATION_ENDPOINTS = (COMPLETIONS, CHAT)
GREEDY_BELOW = 1e-5  # temperatures this small are greedy (as in vLLM): 1/T would overflow
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used in metrics only


@dataclass
class ServeState:
    """Everything the routes need; built by `draftsman.serve.server.load_state`."""

    scheduler: Scheduler
    metrics: ServeMetrics
    tokenizer: Any | None
    eos_ids: frozenset[int]
    vocab_size: int
    model_name: str
    max_model_len: int
    api_key: str | None = None
    spec_steps: int = 0  # 0: plain decoding
    draft_tokens_per_round: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


# ---- helpers -------------------------------------------------------------------------------------
def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return APIError(400, f"malformed JSON body: {detail}", code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    message = f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}"
    return APIError(400, message, loc[0] if loc else None, "invalid_value")


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def chat_prompt(tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Render the messages with the tokenizer's chat template, as `generate --chat` does."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja raises for conversations a template refuses (roles, order)
        raise APIError(400, f"the chat template rejected these messages: {e}", "messages") from None
    return tokenizer.encode(rendered, add_special_tokens=False)


def completion_prompt(tokenizer, req: CompletionRequest, vocab_size: int) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids must lie in [0, {vocab_size}), got {bad[0]}", "prompt")
    return list(prompt)


def build_job(state: ServeState, req: SamplingRequest, prompt: list[int], chat: bool) -> Job:
    """Check limits and turn a validated request into a scheduler job."""
    param = "messages" if chat else "prompt"
    if not prompt:
        raise APIError(400, "the prompt is empty", param)
    max_new = requested_max_tokens(req)
    limit = state.max_model_len
    if max_new is None:  # chat default, as vLLM: the rest of the context
        max_new = limit - len(prompt)
    if len(prompt) + max_new > limit or max_new < 1:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                       f"{len(prompt)} tokens and {max_new} more were requested "
                       f"({len(prompt) + max_new} in all)",
                       param if len(prompt) >= limit else budget_param(req), "context_length_exceeded")
    stops = req.stop_strings()
    if stops and state.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer, and this model has none", "stop")
    temperature = 0.0 if req.temperature < GREEDY_BELOW else req.temperature
    params = SamplingParams(temperature=temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed)
    rules = StopRules(max_new, state.eos_ids, stops, state.tokenizer if stops else None)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    return Job(Request(rid, prompt, rules, params), asyncio.get_running_loop(),
               own_session=req.seed is not None and temperature > 0)


def budget_param(req: SamplingRequest) -> str:
    chat_budget = isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None
    return "max_completion_tokens" if chat_budget else "max_tokens"


async def wait_disconnect(request: HTTPRequest) -> None:
    """Return when the client goes away (the body is already read, so receive() waits for it)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def next_item(job: Job, gone: asyncio.Task) -> Event | JobFailed | None:
    """The job's next event or failure, or None once the client has disconnected."""
    get = asyncio.ensure_future(job.queue.get())
    try:
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():  # also when this handler is cancelled: no getter left behind
            get.cancel()
    return get.result() if get.done() and not get.cancelled() else None


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends, even if the body iterator
    never started (its own `finally` would then never run)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class APIKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <key>` (health and metrics stay open)."""

    def __init__(self, app: ASGIApp, key: str, metrics: ServeMetrics) -> None:
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                if scope["path"] in GENERATION_ENDPOINTS:
                    self.metrics.request_done(scope["path"], 401, None)
                body = error_body("missing or invalid API key (Authorization: Bearer <key>)",
                                  "invalid_request_error", None, "invalid_api_key")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the application -----------------------------------------------------------------------------
# One server-sent event (OpenAPI 3.0/3.1 tools read a text/event-stream schema per event).
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk in OpenAI's format, or [DONE]"},
    "event": {"type": "string"}}}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid or unsupported request"},
    401: {"model": ErrorResponse, "description": "missing or invalid API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    500: {"model": ErrorResponse, "description": "the engine failed on this request"},
    503: {"model": ErrorResponse, "description": "the server is shutting down"},
}


def create_app(state: ServeState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.scheduler.start()
        yield
        state.scheduler.stop()

    app = FastAPI(title="draftsman serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions with EAGLE-3 speculative decoding.")
    app.state.serve = state
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, key=state.api_key, metrics=state.metrics)
    # With a key, the schema documents bearer auth (the middleware enforces it).
    auth = [Depends(HTTPBearer(auto_error=False))] if state.api_key else []
    metrics = state.metrics

    def error_response(request: HTTPRequest, err: APIError) -> JSONResponse:
        if request.url.path in GENERATION_ENDPOINTS:
            reason = "error" if err.status >= 500 else "cancelled" if err.status == CLIENT_CLOSED else None
            metrics.request_done(request.url.path, err.status, reason)
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(APIError)
    async def on_api_error(request: HTTPRequest, err: APIError) -> JSONResponse:
        return error_response(request, err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: HTTPRequest, err: RequestValidationError) -> JSONResponse:
        return error_response(request, validation_error(list(err.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: HTTPRequest, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(err.detail), kind), err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def on_internal_error(request: HTTPRequest, err: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return error_response(request, APIError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        if state.scheduler.closed:
            return JSONResponse(error_body("shutting down", "unavailable"), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, dependencies=auth,
             responses={401: ERROR_RESPONSES[401]})
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": state.created, "owned_by": "draftsman",
                                            "max_model_len": state.max_model_len}]}

    def generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
        ok = {"model": model, "description": "the completion, or with stream=true server-sent "
              "events (`data: {chunk}` lines ending with `data: [DONE]`)",
              "content": {"text/event-stream": {"schema": SSE_EVENT}}}
        return {200: ok, **ERROR_RESPONSES}

    @app.post(COMPLETIONS, response_model=None, dependencies=auth,
              responses=generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        check_request(body)
        check_model(body)
        # Tokenizing may take a while for long prompts: off the event loop.
        prompt = await run_in_threadpool(completion_prompt, state.tokenizer, body, state.vocab_size)
        return await run(body, request, prompt, chat=False)

    @app.post(CHAT, response_model=None, dependencies=auth,
              responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        check_request(body)
        check_model(body)
        prompt = await run_in_threadpool(chat_prompt, state.tokenizer, body)
        return await run(body, request, prompt, chat=True)

    def check_model(req: SamplingRequest) -> None:
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"the model `{req.model}` does not exist; this server serves "
                           f"`{state.model_name}`", "model", "model_not_found")

    async def run(req: SamplingRequest, request: HTTPRequest, prompt: list[int], chat: bool) -> Response:
        job = build_job(state, req, prompt, chat)
        try:
            state.scheduler.submit(job)
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        gone = asyncio.create_task(wait_disconnect(request))
        streaming = False
        try:
            # Wait for the first token before answering, so that a failure at admission is a
            # proper 500 even for a stream.
            first = await next_item(job, gone)
            fail_early(first, job)
            endpoint = CHAT if chat else COMPLETIONS
            if req.stream:
                streaming = True  # from here the stream owns `gone` and the job

                def on_close() -> None:
                    gone.cancel()
                    state.scheduler.cancel(job.request_id)  # a no-op once it has finished

                return EventStream(stream(req, job, first, gone, chat, endpoint), on_close)
            return await collect(req, job, first, gone, chat, endpoint)
        except BaseException:  # an error, or this handler cancelled (e.g. shutdown timeout)
            state.scheduler.cancel(job.request_id)
            raise
        finally:
            if not streaming:
                gone.cancel()

    def fail_early(item: Event | JobFailed | None, job: Job) -> None:
        if item is None:
            state.scheduler.cancel(job.request_id)
            raise APIError(CLIENT_CLOSED, "the client closed the connection", code="client_closed")
        if isinstance(item, JobFailed):
            raise APIError(500, f"internal error while decoding: {item}", code="engine_error")
        if item.finish_reason == "cancelled":
            raise APIError(503, "the server shut down before the request finished", code="shutting_down")

    def summary(job: Job) -> dict[str, Any]:
        r = job.request
        tokens = r.state.tokens
        out: dict[str, Any] = {"usage": {"prompt_tokens": len(r.prompt), "completion_tokens": len(tokens),
                                         "total_tokens": len(r.prompt) + len(tokens)}}
        if state.spec_steps:
            hist = r.histogram or [0] * (state.spec_steps + 1)
            out["spec_decoding"] = spec_decoding_fields(summarize_histogram(hist, state.draft_tokens_per_round,
                                                                            drafted=r.drafted)
                                                        | {"plain_rounds": r.plain_rounds})
        return out

    async def collect(req: SamplingRequest, job: Job, item: Event | JobFailed | None, gone: asyncio.Task,
                      chat: bool, endpoint: str) -> JSONResponse:
        tokens: list[int] = []
        while True:
            fail_early(item, job)
            assert isinstance(item, Event)
            tokens += item.tokens
            if item.finish_reason is not None:
                break
            item = await next_item(job, gone)
        text = final_text(state.tokenizer, tokens, req.stop_strings())
        reason = item.finish_reason
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason, "token_ids": tokens}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {"id": job.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": state.model_name, "choices": [choice],
                **summary(job)}
        metrics.request_done(endpoint, 200, reason)
        return JSONResponse(body)

    async def stream(req: SamplingRequest, job: Job, item: Event | JobFailed | None, gone: asyncio.Task,
                     chat: bool, endpoint: str) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": job.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": state.model_name}

        def chunk(text: str | None, tokens: list[int], reason: str | None, **extra: Any) -> dict:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
            if chat:
                choice["delta"] = {} if text is None else {"content": text}
            else:
                choice["text"] = text or ""
            choice["token_ids"] = tokens
            out = {**base, "choices": [choice], **extra}
            return {**out, "usage": None} if include_usage and "usage" not in out else out

        text = TextStream(state.tokenizer, req.stop_strings())
        done = False
        try:
            if chat:
                first = chunk(None, [], None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield sse(first)
            while True:
                if item is None:
                    return  # client gone: `finally` frees the slot
                if isinstance(item, JobFailed):
                    metrics.request_done(endpoint, 500, "error")
                    yield sse(error_body(f"internal error while decoding: {item}", "internal_error",
                                         None, "engine_error"))
                    yield sse("[DONE]")
                    done = True
                    return
                reason = item.finish_reason
                if reason == "cancelled":
                    reason = "abort"  # the server is shutting down
                delta = text.push(item.tokens) + (text.finish() if reason else "")
                if delta or item.tokens or reason:
                    extra = {k: v for k, v in summary(job).items() if k == "spec_decoding"} if reason else {}
                    yield sse(chunk(delta, list(item.tokens), reason, **extra))
                if reason:
                    if include_usage:
                        yield sse({**base, "choices": [], **summary(job)})
                    yield sse("[DONE]")
                    metrics.request_done(endpoint, 200, reason)
                    done = True
                    return
                item = await next_item(job, gone)
        finally:
            gone.cancel()
            if not done:
                state.scheduler.cancel(job.request_id)
                metrics.request_done(endpoint, CLIENT_CLOSED, "cancelled")

    return app
