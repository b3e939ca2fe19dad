"""Request bodies of the OpenAI-compatible API (the fields `kiln serve` understands).

Unknown fields are ignored, as OpenAI clients send many optional ones. Fields that would change the
result but are not implemented (n > 1, penalties, logit_bias, tools, JSON mode …) are refused with a
400 by `unsupported()` rather than silently ignored. vLLM's extra sampling fields `top_k`,
`ignore_eos`, `min_tokens`, `stop_token_ids` are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Request):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
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


class CompletionRequest(_Sampling):
    # str | list[str] | list[int] (one tokenized prompt) | list[list[int]] (a batch of them)
    prompt: str | list[str] | list[int] | list[list[int]]
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
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
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


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages formatted with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


Endpoint = Literal["completions", "chat"]
