"""Request bodies sent slowly time out (security finding 12): runtime/body_limit.py, used by `kiln api`
and `kiln serve`. Over raw sockets against a `kiln api` subprocess: a client that sends headers and
part of a body and then nothing gets 408 and a closed connection within the idle timeout, one that
trickles bytes within the whole-body timeout, and other clients are served meanwhile. A body sent
in chunks with short pauses still works, and a streaming response is never cut: once the body is
complete nothing is timed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from runtime.body_limit import BodySizeLimit
from tests.reliability.kiln_api import KilnApi, kiln_api

pytestmark = pytest.mark.timing

TOTAL_S = 4.0
IDLE_S = 1.5
MARGIN_S = 5.0  # generous: the machine is shared


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnApi]:
    env = {"KILN_REQUEST_BODY_TIMEOUT_S": str(TOTAL_S), "KILN_REQUEST_BODY_IDLE_TIMEOUT_S": str(IDLE_S)}
    with kiln_api(tmp_path_factory.mktemp("kiln-api"), **env) as server:
        yield server


def open_partial(
    port: int, token: str, length: int = 100, sent: bytes = b'{"source": "/x", '
) -> socket.socket:
    """A POST whose headers promise `length` bytes of body, of which only `sent` are sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        "POST /v1/plans HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {length}\r\n\r\n"
    )
    sock.sendall(head.encode() + sent)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (seconds).

    A reset counts as the close: a byte the client sent after the server's answer reaches a socket
    the server has closed, and TCP answers it with RST instead of FIN."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, float("inf")
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return data, time.monotonic() - t0


def test_a_body_that_stops_coming_is_a_408_and_a_closed_connection(api: KilnApi) -> None:
    sock = open_partial(api.port, api.admin_token)
    data, closed_after = read_until_closed(sock, IDLE_S + MARGIN_S)
    assert closed_after < IDLE_S + MARGIN_S, f"still open after {IDLE_S + MARGIN_S} s: {data!r}"
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert b"did not arrive in time" in data and b"connection: close" in data.lower()


def test_a_trickled_body_is_cut_at_the_whole_body_timeout(api: KilnApi) -> None:
    sock = open_partial(api.port, api.admin_token, length=10_000, sent=b"{")
    t0 = time.monotonic()
    sock.settimeout(0.5)
    answer = b""
    while time.monotonic() - t0 < TOTAL_S + MARGIN_S:
        # Read first, then trickle: a byte sent once the answer is in flight would meet a closed
        # socket, whose RST makes the kernel drop the unread answer.
        try:
            answer += sock.recv(65536)
        except TimeoutError:
            pass
        except ConnectionResetError:
            break
        if answer:
            break
        try:
            sock.sendall(b" ")  # one byte per half second: never idle for IDLE_S
        except OSError:  # the server closed the connection
            break
    rest, _ = read_until_closed(sock, MARGIN_S)
    answer += rest
    elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert elapsed < TOTAL_S + MARGIN_S, f"answered after {elapsed:.1f} s"


def test_other_clients_are_served_while_slow_bodies_hang(api: KilnApi) -> None:
    slow = [open_partial(api.port, api.admin_token) for _ in range(4)]
    try:
        auth = {"Authorization": f"Bearer {api.admin_token}"}
        for _ in range(3):
            t0 = time.perf_counter()
            assert httpx.get(f"{api.url}/health", timeout=10).status_code == 200
            assert httpx.get(f"{api.url}/v1/conversions", headers=auth, timeout=10).status_code == 200
            assert time.perf_counter() - t0 < 1.0
        closed = [read_until_closed(s, IDLE_S + MARGIN_S) for s in slow]
    finally:
        for s in slow:
            s.close()
    assert all(data.startswith(b"HTTP/1.1 408 ") for data, _ in closed), closed


def test_a_body_sent_in_chunks_with_short_pauses_is_read(api: KilnApi, tmp_path: Path) -> None:
    body = b'{"source": "' + str(tmp_path / "missing").encode() + b'", "targets": ["cpu"]}'
    third = len(body) // 3
    sock = open_partial(api.port, api.admin_token, length=len(body), sent=body[:third])
    for part in (body[third : 2 * third], body[2 * third :]):  # within TOTAL_S, no pause near IDLE_S
        time.sleep(IDLE_S / 3)
        sock.sendall(part)
    sock.settimeout(30)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 404 "), answer  # planned (no checkpoint there), not a 408


def test_a_streaming_response_is_not_cut_once_the_body_is_complete(serve_app: Callable[..., str]) -> None:
    """kiln serve streams completions while Starlette waits on `receive` for the client's disconnect."""

    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def ticks() -> AsyncIterator[bytes]:
            for i in range(6):
                yield f"tick {i}\n".encode()
                await anyio.sleep(0.5)

        return StreamingResponse(ticks(), media_type="text/plain")

    app = BodySizeLimit(
        Starlette(routes=[Route("/stream", stream, methods=["POST"])]),
        max_bytes=1 << 20,
        body_timeout_s=1.0,
        body_idle_timeout_s=0.5,
    )
    url = serve_app(app)
    r = httpx.post(f"{url}/stream", content=b"{}", timeout=30)
    assert r.status_code == 200 and r.text.count("tick") == 6, r.text
