"""Response headers of every /console response: a Content-Security-Policy that allows scripts and
styles from the API's own origin only (no inline script, no inline style, no eval), no framing, no
referrer, no MIME sniffing."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONSOLE_PREFIX = "/console"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
CONSOLE_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class ConsoleHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *CONSOLE_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)
