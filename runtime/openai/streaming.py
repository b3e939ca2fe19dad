"""Server-sent events: the framing, the response, and the outputs of several jobs merged into one stream.

A streamed response answers 200 before its first event, so an error after that point is sent as an
event holding OpenAI's error body, followed by `data: [DONE]` like every stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from runtime.engine import RequestOutput
from runtime.openai.errors import engine_error
from runtime.openai.serving import Submitted

SSE_DONE = b"data: [DONE]\n\n"
Indexed = tuple[int, RequestOutput]  # (job index, output)


def sse_event(chunk: BaseModel, exclude: set[str] | None = None) -> bytes:
    return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"


def sse_error(e: Exception) -> bytes:
    return sse_event(engine_error(e).model())


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def merged(submitted: Sequence[Submitted]) -> AsyncGenerator[Indexed, None]:
    """The outputs of submitted jobs (the first ones included) as they arrive. Closing this stream
    aborts every job still running."""
    if len(submitted) == 1:
        first, rest = submitted[0]
        try:
            yield 0, first
            async for out in rest:
                yield 0, out
        finally:
            await rest.aclose()
        return
    queue: asyncio.Queue[Indexed | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, submitted[i].first))
            async for out in submitted[i].rest:
                await queue.put((i, out))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(submitted))]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield item
        for t in tasks:
            t.result()
    finally:
        for t in tasks:
            t.cancel()
        for sub in submitted:
            await sub.rest.aclose()
