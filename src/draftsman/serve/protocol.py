"""OpenAI API request and response shapes (the subset draftsman serves), and their checks.

Requests are validated strictly (no "5" for 5, no true for 1) and unknown fields are refused, so a
typo is an error naming the field rather than a silently ignored setting. Parameters of the
OpenAI API that draftsman does not implement (n > 1, logprobs, tools, penalties, ...) are declared
so that the schema documents them, and refused with a 400 naming the parameter when set to
anything but their neutral value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True)
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT
    model: str | None = Field(None, description="served model name (default: the one model)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off (vLLM's extension)")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP_STRINGS} stop strings")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1,
                             description="with temperature > 0: decoded in a session seeded with it")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Declared but only their neutral values are served:
    n: int = Field(1, ge=1, description="only 1 is supported")
    presence_penalty: float = Field(0.0, description="only 0 is supported")
    frequency_penalty: float = Field(0.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(stops)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="one prompt: text, or token ids")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most (default 16)")
    logprobs: int | None = Field(None, description="not supported")
    echo: bool = Field(False, description="not supported")
    best_of: int | None = Field(None, description="only 1 is supported")
    suffix: str | None = Field(None, description="not supported")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = Field(False, description="not supported")
    top_logprobs: int | None = Field(None, description="not supported")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported")
    tool_choice: str | dict[str, Any] | None = Field(None, description="not supported")
    parallel_tool_calls: bool | None = Field(None, description="not supported")
    functions: list[dict[str, Any]] | None = Field(None, description="not supported")
    function_call: str | dict[str, Any] | None = Field(None, description="not supported")
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')


# ---- checks --------------------------------------------------------------------------------------
# Each declared-but-unserved parameter, and the values that mean "off".
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "logit_bias": lambda v: not v,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: not v,
    "echo": lambda v: v is False,
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
}


def unsupported_parameter(req: SamplingRequest) -> str | None:
    """The first parameter set to a value draftsman does not serve, or None."""
    fields = type(req).model_fields
    return next((name for name, off in NEUTRAL.items() if name in fields and not off(getattr(req, name))),
                None)


def check_request(req: SamplingRequest) -> None:
    """Checks pydantic cannot express; raise APIError(400) naming the parameter."""
    name = unsupported_parameter(req)
    if name is not None:
        value = getattr(req, name)
        raise APIError(400, f"{name}={value!r} is not supported by draftsman serve", name,
                       "unsupported_parameter")
    stops = req.stop_strings()
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop")


def requested_max_tokens(req: SamplingRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


# ---- responses -----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecoding(BaseModel):
    """This request's speculation figures (definitions of SGLang and vLLM)."""

    accept_length: float = Field(description="tau: tokens emitted per target verify forward")
    accept_rate_per_position: list[float] = Field(description="rounds accepting >= i+1 drafts / rounds")
    rounds: int = Field(description="speculative rounds: target verify forwards (drafts)")
    plain_rounds: int = Field(description="rounds that decoded this request plainly (adaptive speculation: "
                              "where speculating would have been slower)")
    draft_tokens: int = Field(description="drafted tokens verified: rounds x (draft tokens - 1)")
    accepted_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] = Field(description="generated token ids (draftsman's extension)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    spec_decoding: SpecDecoding | None = Field(None, description="present when speculating")


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    spec_decoding: SpecDecoding | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def spec_decoding_fields(summary: dict) -> dict:
    """The `spec_decoding` extra field from `summarize_histogram`'s result."""
    return {
        "accept_length": round(summary["accept_length"], 4),
        "accept_rate_per_position": [round(p, 4) for p in summary["accept_rate_per_position"]],
        "rounds": summary["rounds"],
        "plain_rounds": summary["plain_rounds"],
        "draft_tokens": summary["drafted_tokens"],
        "accepted_tokens": summary["accepted_tokens"],
    }
