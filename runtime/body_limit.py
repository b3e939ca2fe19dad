"""ASGI middleware refusing request bodies over a size limit with 413, before the app reads them.

Checked on the declared Content-Length and again while a (chunked) body streams in, so a client
cannot get past it by omitting the header. Used by `kiln serve` and by the conversion API, each
with its own error body shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ErrorBody = Callable[[str], dict[str, Any]]


def detail_body(message: str) -> dict[str, Any]:
    return {"detail": message}


class BodySizeLimit:
    """Refuse bodies over `max_bytes` with 413, by Content-Length and while streaming (chunked)."""

    def __init__(self, app: ASGIApp, max_bytes: int, error_body: ErrorBody = detail_body) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_body = error_body

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
                    await self._reject(send)
                    return
        received = 0
        too_large = False
        rejected = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True  # the app sees a disconnect; its response is replaced by a 413
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal rejected
            if not too_large:
                await send(message)
            elif not rejected:
                rejected = True
                await self._reject(send)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not rejected:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes"
        body = json.dumps(self.error_body(message)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
