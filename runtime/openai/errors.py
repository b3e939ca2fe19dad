"""OpenAI's error body (`{"error": {"message", "type", "param", "code"}}`) and what raises map to it."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

from runtime.chat import ChatTemplateError
from runtime.engine import ContextLengthError, EngineDeadError, RequestFailedError
from runtime.openai.protocol import ErrorInfo, ErrorResponse
from runtime.request_limits import RequestTooLargeError
from runtime.sampling import InvalidRequestError

log = logging.getLogger(__name__)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class OpenAIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def model(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def body(self) -> dict[str, Any]:
        return self.model().model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def engine_error(e: Exception) -> OpenAIError:
    """The OpenAI error an exception raised while submitting or running a request means."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, RequestTooLargeError):
        return OpenAIError(400, str(e), param=e.param, code="request_too_large")
    if isinstance(e, RequestFailedError):
        return OpenAIError(500, str(e), type_="server_error", code="request_failed")
    if isinstance(e, ContextLengthError):
        return OpenAIError(400, str(e), param="messages", code=CONTEXT_LENGTH_EXCEEDED)
    if isinstance(e, InvalidRequestError):
        return OpenAIError(400, str(e), param=e.param)
    if isinstance(e, ChatTemplateError):
        return OpenAIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), type_="server_error", code="engine_dead")
    log.exception("request failed")
    return OpenAIError(500, f"internal error: {e}", type_="server_error")


def context_error(e: ContextLengthError, prompt_param: str) -> OpenAIError:
    """A request the context check refused, worded for API clients; `prompt_param` is the field that
    carries the prompt ("prompt" or "messages")."""
    limit = f"This model's maximum context length is {e.max_model_len} tokens."
    if e.prompt_len == 0:
        return OpenAIError(400, "the prompt is empty", param="prompt")
    if e.param == "prompt":
        message = f"{limit} However, your prompt has {e.prompt_len} tokens; shorten it."
        return OpenAIError(400, message, param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    total = e.prompt_len + (e.max_tokens or 0)
    message = (
        f"{limit} However, you requested {total} tokens ({e.prompt_len} in the prompt, {e.max_tokens} "
        "to generate). Reduce the prompt or max_tokens."
    )
    return OpenAIError(400, message, param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
