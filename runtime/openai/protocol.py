"""The OpenAI-compatible API's bodies: the requests `kiln serve` understands and the responses it sends.

Requests ignore unknown fields, as OpenAI clients send many optional ones. Fields that would change the
result but are not implemented (n > 1, penalties, logit_bias, tools, JSON mode …) are refused with a
400 by `unsupported()` rather than silently ignored. vLLM's extra sampling fields `top_k`,
`ignore_eos`, `min_tokens`, `stop_token_ids` are accepted.

Every declared field of a response is sent, explicit nulls included (`"stop_reason": null`,
`"logprobs": null`), except a stream chunk's `usage` without `stream_options.include_usage` and the
unset fields of a chat `delta`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from runtime.request_limits import (
    MAX_CHAT_MESSAGES,
    MAX_DETOKENIZE_IDS,
    MAX_PROMPT_IDS,
    MAX_PROMPTS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from runtime.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN

# OpenAI's chat roles; others are refused with a 400 as the OpenAI API does.
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
TokenId = Annotated[StrictInt, Field(ge=0)]  # not bool: `[true]` is not token id 1


def at_most(cap: int) -> BeforeValidator:
    """Refuse a list longer than `cap` before its items are validated (which costs per item)."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > cap:
            raise ValueError(f"has {len(value)} items; at most {cap} are allowed")
        return value

    return BeforeValidator(check)


def prompt_at_most(value: Any) -> Any:
    """A prompt list: at most MAX_PROMPTS prompts, or one prompt of at most MAX_PROMPT_IDS ids."""
    if isinstance(value, list) and len(value) > MAX_PROMPTS:
        if any(isinstance(item, str | list) for item in value[:1]):
            raise ValueError(f"has {len(value)} prompts; at most {MAX_PROMPTS} are allowed per request")
        if len(value) > MAX_PROMPT_IDS:
            raise ValueError(f"has {len(value)} token ids; at most {MAX_PROMPT_IDS} are allowed")
    return value


# Long id lists (prompts, ids to detokenize) are validated as plain ints, five times faster than
# TokenId; their range is checked against the vocabulary afterwards (min / max).
TokenIds = Annotated[list[StrictInt], at_most(MAX_PROMPT_IDS)]


# --- requests -------------------------------------------------------------------------------------


def lone_surrogate_path(value: Any, path: str = "body") -> str | None:
    """Path of the first string (or key) holding a lone UTF-16 surrogate, or None. JSON allows
    "\\ud800", but it is not valid Unicode text and cannot be tokenized."""
    found = _surrogate_at(value)
    return None if found is None else path + "".join(reversed(found))


_SCALARS = frozenset({int, float, bool, type(None)})


def _surrogate_at(value: Any) -> list[str] | None:
    """The path segments (innermost first) to the first lone surrogate in `value`, or None. Only
    containers and strings are visited, so a long list of token ids costs one type check per id."""
    if isinstance(value, str):
        return None if value.isascii() or not _has_surrogate(value) else []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _has_surrogate(key):
                return [f".{_printable(key)}"]
            if isinstance(item, str | dict | list) and (inner := _surrogate_at(item)) is not None:
                return [*inner, f".{_printable(key)}"]
    elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):
        for i, item in enumerate(value):
            if isinstance(item, str | dict | list) and (inner := _surrogate_at(item)) is not None:
                return [*inner, f"[{i}]"]
    return None


def _printable(key: Any) -> str:
    """A key as it can appear in an error message (a lone surrogate escaped as \\udXXX)."""
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(_Request):
    """A whole request body: refuses lone surrogates anywhere in it with a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            field = where.removeprefix("body").lstrip(".") or "body"
            raise ValueError(f"{field} contains a lone UTF-16 surrogate, which is not valid Unicode text")
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Annotated[str | list[str] | None, at_most(MAX_STOP_STRINGS)] = None
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS)] = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of the first set field this server does not implement, or None."""
        if self.n != 1:
            return "n", "only n=1 is supported; send several requests for several samples"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence_penalty / frequency_penalty are not supported"
        if self.repetition_penalty not in (None, 1.0):
            return "repetition_penalty", "repetition_penalty is not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    # str | list[str] | list[int] (one tokenized prompt) | list[list[int]] (a batch of them)
    prompt: Annotated[str | TokenIds | list[str] | list[TokenIds], BeforeValidator(prompt_at_most)]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        return super().unsupported()


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], at_most(MAX_CHAT_MESSAGES), Field(min_length=1)]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format {'type': 'text'} is supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs requires logprobs=true"
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and any(p.get("type") != "text" for p in m.content):
                return f"messages[{i}].content", "only text content parts are supported"
        return super().unsupported()

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                d["content"] = "".join(str(p.get("text", "")) for p in m.content)
            out.append(d)
        return out


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages formatted with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage] | None, at_most(MAX_CHAT_MESSAGES)] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Annotated[list[StrictInt], at_most(MAX_DETOKENIZE_IDS)]


# --- responses ------------------------------------------------------------------------------------


class _Response(BaseModel):
    # model_dump_json (the SSE events) writes NaN and ±Infinity as Python's json module does.
    model_config = ConfigDict(ser_json_inf_nan="constants")


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    error: ErrorInfo


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    """lm-evaluation-harness reads these: the first prompt token has no logprob and no top dict."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    """One SSE chunk of a streamed completion; `usage` is sent (null but in the last) with include_usage."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


def _is_none(value: Any) -> bool:
    return value is None


class DeltaMessage(_Response):
    """What a chat chunk adds to the message: only the fields that are set are sent (`{}` at the end)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(_Response):
    """One SSE chunk of a streamed chat completion; `usage` as in CompletionStreamResponse."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    root: str
    parent: str | None = None
    max_model_len: int | None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(_Response):
    version: str


class TokenizeResponse(_Response):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(_Response):
    """What a client needs to tokenize like the server (lm-evaluation-harness's remote tokenizer)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | dict[str, str] | None
    model_max_length: int | None
