"""ASGI middleware guarding request bodies before the app reads them: size (413) and time (408).

Size is checked on the declared Content-Length and again while a (chunked) body streams in, so a
client cannot get past it by omitting the header. Time: the whole body must arrive within
`body_timeout_s` of the request's start, with no gap longer than `body_idle_timeout_s` between
chunks; otherwise the answer is 408 and the connection is closed, so a client that sends headers
and part of a body and then nothing holds no connection, task or buffer for long. Once the body is
complete, `receive` is not timed (a streaming response waits on it for the client's disconnect).

Used by `kiln serve` and by the conversion API, each with its own error body shape.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ErrorBody = Callable[[str], dict[str, Any]]
BODY_TIMEOUT_S = 60.0  # the whole body, from the start of the request
BODY_IDLE_TIMEOUT_S = 15.0  # the longest wait for the next chunk of a body


def detail_body(message: str) -> dict[str, Any]:
    return {"detail": message}


class BodySizeLimit:
    """Refuse bodies over `max_bytes` with 413, by Content-Length and while streaming (chunked), and
    bodies that do not arrive in time with 408 (the connection closed after it)."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        error_body: ErrorBody = detail_body,
        *,
        body_timeout_s: float = BODY_TIMEOUT_S,
        body_idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
        timeout_error_body: ErrorBody = detail_body,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_body = error_body
        self.body_timeout_s = body_timeout_s
        self.body_idle_timeout_s = body_idle_timeout_s
        self.timeout_error_body = timeout_error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send, 413)
                    return
        deadline = time.monotonic() + self.body_timeout_s
        received = 0
        body_done = False
        refusal: int | None = None  # 413 or 408 once the body is refused
        started = rejected = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done, refusal
            if refusal is not None:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            wait = min(self.body_idle_timeout_s, deadline - time.monotonic())
            with anyio.move_on_after(max(wait, 0.0)) as timer:
                message = await receive()
            if timer.cancelled_caught:
                refusal = 408  # the app sees a disconnect; its response is replaced by a 408
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    refusal = 413  # the app sees a disconnect; its response is replaced by a 413
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started, rejected
            if refusal is None:
                started = started or message["type"] == "http.response.start"
                await send(message)
            elif not rejected and not started:
                rejected = True
                await self._reject(send, refusal)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if refusal is None:
                raise
        if refusal is not None and not rejected and not started:
            await self._reject(send, refusal)

    async def _reject(self, send: Send, status: int) -> None:
        if status == 408:
            limit = f"{self.body_timeout_s:g} s" if math.isfinite(self.body_timeout_s) else "its limit"
            message = (
                f"the request body did not arrive in time (all of it within {limit}, "
                f"no pause over {self.body_idle_timeout_s:g} s)"
            )
            body = json.dumps(self.timeout_error_body(message)).encode()
        else:
            body = json.dumps(self.error_body(f"request body exceeds {self.max_bytes} bytes")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 408:
            headers.append((b"connection", b"close"))  # the rest of the body is never read
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
