"""`kiln serve --api-key`: every request must carry `Authorization: Bearer <key>`.

Every path but /health, /metrics and /version (open for load balancers and scrapers) is guarded:
the API under /v1, /tokenize (which renders chat templates), /detokenize, /tokenizer_info, the
OpenAPI pages and unknown paths alike. The header is compared in constant time
(hmac.compare_digest); a missing or wrong key is a 401 with OpenAI's error body
(`code: invalid_api_key`).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.openai.errors import OpenAIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("path", "") not in OPEN_PATHS:
            given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    error = OpenAIError(
        401, "invalid or missing API key: send `Authorization: Bearer <key>`", code="invalid_api_key"
    )
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
