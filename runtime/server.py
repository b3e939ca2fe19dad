"""OpenAI-compatible HTTP server over the AsyncEngine (`kiln serve`).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with
`stream_options.include_usage`), GET /health, GET /metrics (Prometheus, vLLM's metric names),
GET /version, and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info (which let
lm-evaluation-harness tokenize through the server). Errors use OpenAI's body
`{"error": {"message", "type", "param", "code"}}`: 400 for invalid parameters and context overflow,
404 for an unknown model or route.

The handlers only tokenize, validate and format: prefill and decode run in the AsyncEngine's thread,
and tokenization / chat templating / detokenizing a whole prompt run in a worker thread, so a large
prompt never stalls the event loop (health checks, other streams). Request bodies over
`max_request_bytes` are refused with 413 before they are read. A client that disconnects (streaming
or not) has its requests aborted, which frees their slots.

Completions with `echo` + `logprobs` return prompt log-likelihoods the way lm-evaluation-harness's
`local-completions` reads them: `logprobs.tokens`, `token_logprobs` (first entry null),
`top_logprobs` (a dict per position holding the top-n tokens *and* the actual token, first entry
null) and `text_offset`. `max_tokens=0` with echo returns the prompt alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from runtime.body_limit import BodySizeLimit
from runtime.chat import ChatTemplateError, apply_chat_template
from runtime.engine import AsyncEngine, ContextLengthError, RequestOutput
from runtime.metrics import CONTENT_TYPE, RequestTracker, ServerMetrics
from runtime.sampling import InvalidRequestError, SamplingParams, TokenLogprob
from runtime.server_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way
SSE_DONE = b"data: [DONE]\n\n"


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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class _Disconnected(Exception):
    """The HTTP client went away before the response was complete."""


def _engine_error(e: Exception) -> OpenAIError:
    """Map an exception raised when submitting a request to the OpenAI error it means."""
    if isinstance(e, ContextLengthError):
        return OpenAIError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, InvalidRequestError | ChatTemplateError):
        return OpenAIError(400, str(e))
    log.exception("request failed")
    return OpenAIError(500, f"internal error: {e}", type_="server_error")


# --- tokenizer helpers ----------------------------------------------------------------------------


class _TokenTexts:
    """Display strings of single tokens (as in vLLM's logprobs), cached per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            tokens = self._tok.convert_ids_to_tokens([token_id])
            text = self._tok.convert_tokens_to_string(tokens) if tokens and tokens[0] is not None else ""
            self._cache[token_id] = text
        return text


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


# --- per-request result ---------------------------------------------------------------------------


@dataclass
class _Result:
    """Everything one engine request produced (non-streaming) or has produced so far (streaming)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.text_delta
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason


@dataclass
class _Job:
    """One engine request: id, prompt, params, and how the server post-processes it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drop_generated: bool = False  # max_tokens=0 with echo: the engine generates one token, not shown


def _usage(results: Iterable[_Result], jobs: Iterable[_Job]) -> dict[str, int]:
    prompt = completion = 0
    for res, job in zip(results, jobs, strict=True):
        prompt += len(res.prompt_ids)
        completion += 0 if job.drop_generated else len(res.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


# --- the service ----------------------------------------------------------------------------------


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        served_model_name: str,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int | None,
        root: str | None,
    ) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = tokenizer
        self.max_model_len: int | None = max_model_len or engine.engine.max_model_len
        self.root = root
        self.created = int(time.time())
        self.token_text = _TokenTexts(tokenizer)
        self.metrics = ServerMetrics(
            served_model_name, lambda: engine.num_running, lambda: engine.num_waiting
        )

    # --- validation -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def max_tokens_for(
        self, prompt_len: int, requested: int | None, default: int | None, prompt_param: str = "messages"
    ) -> int:
        if prompt_len == 0:
            raise OpenAIError(400, "the prompt is empty", param="prompt")
        limit = self.max_model_len
        wanted = requested if requested is not None else default
        if limit is not None:
            if prompt_len >= limit and (wanted is None or wanted > 0):
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your prompt has "
                    f"{prompt_len} tokens; shorten it.",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            if wanted is None:
                wanted = limit - prompt_len
            elif prompt_len + wanted > limit:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} to generate). "
                    "Reduce the prompt or max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        if wanted is None:
            raise OpenAIError(
                400, "max_tokens is required (the server has no context limit)", param="max_tokens"
            )
        return wanted

    async def encode_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            texts: list[str] | None = [prompt]
            batch: list[list[int]] = []
        elif prompt and all(isinstance(p, str) for p in prompt):
            texts = [str(p) for p in prompt]
            batch = []
        elif prompt and all(isinstance(p, int) for p in prompt):
            texts, batch = None, [[int(t) for t in prompt]]  # type: ignore[union-attr]
        elif prompt and all(isinstance(p, list) for p in prompt):
            texts, batch = None, [list(p) for p in prompt]  # type: ignore[arg-type]
        else:
            raise OpenAIError(
                400,
                "prompt must be a string, a list of strings, a list of token ids or a "
                "list of token-id lists, and not empty",
                param="prompt",
            )
        if texts is not None:
            tokenizer = self.tokenizer
            batch = await asyncio.to_thread(lambda: [list(tokenizer(t)["input_ids"]) for t in texts])
        return batch

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The chat template applied and tokenized, off the event loop."""
        try:
            return await asyncio.to_thread(
                apply_chat_template, self.tokenizer, messages, add_generation_prompt=add_generation_prompt
            )
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), param="messages") from e

    async def decode(self, ids: list[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode, ids)

    @staticmethod
    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
        )
        return params

    # --- engine plumbing ----------------------------------------------------------------------------

    async def start(
        self, job: _Job, tracker: RequestTracker
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Submit a job and wait for its first output (so submission errors become a 400, not a broken
        stream). Returns the iterator and that first output."""
        tracker.prompt(len(job.prompt_ids))
        try:
            job.params.validate()
            it = self.engine.generate(job.request_id, job.prompt_ids, job.params)
            first = await it.__anext__()
        except StopAsyncIteration as e:
            tracker.finish("abort")
            raise OpenAIError(500, "the engine ended the request without output", type_="server_error") from e
        except OpenAIError:
            tracker.finish("abort")
            raise
        except Exception as e:
            tracker.finish("abort")
            raise _engine_error(e) from e
        tracker.tokens(len(first.new_token_ids))
        return it, first

    async def outputs(self, job: _Job, tracker: RequestTracker) -> AsyncIterator[RequestOutput]:
        """All outputs of a job, the first included. Closing this iterator early aborts the request."""
        it, first = await self.start(job, tracker)
        finished = bool(first.finished)
        try:
            yield first
            while not finished:
                out = await it.__anext__()
                tracker.tokens(len(out.new_token_ids))
                finished = bool(out.finished)
                if finished:
                    tracker.finish(out.finish_reason)
                yield out
        except StopAsyncIteration:
            finished = True
        finally:
            if not finished:
                self.abort(job.request_id)
                tracker.finish("abort")
            elif not tracker.done:
                tracker.finish(first.finish_reason)
            with contextlib.suppress(Exception):
                await it.aclose()

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # aborting a finished or unknown request is not an error worth surfacing
            log.debug("abort(%s) failed", request_id, exc_info=True)

    async def collect(self, request: Request, jobs: list[_Job]) -> list[_Result]:
        """Run jobs concurrently to completion; abort all of them if the client disconnects."""
        results = [_Result(prompt_ids=j.prompt_ids) for j in jobs]
        trackers = [self.metrics.track() for _ in jobs]
        # Submit every job first so a bad one fails before any runs for long.
        started: list[AsyncIterator[RequestOutput]] = []
        try:
            for job, tracker in zip(jobs, trackers, strict=True):
                started.append(self.outputs(job, tracker))
            firsts = [await anext(s) for s in started]
        except BaseException:
            for s in started:
                await s.aclose()
            for t in trackers:
                t.finish("abort")
            raise

        async def drain(i: int) -> None:
            results[i].add(firsts[i])
            async for out in started[i]:
                results[i].add(out)

        work = asyncio.ensure_future(asyncio.gather(*(drain(i) for i in range(len(jobs)))))
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise _Disconnected
            work.result()
        finally:
            watcher.cancel()
            if not work.done():
                # Cancelling the drains closes their output streams, which aborts the requests.
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            for s in started:
                await s.aclose()
        return results

    # --- formatting -----------------------------------------------------------------------------------

    def top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self.token_text(t): _lp(v) for t, v in entry.top.items()}
        top[self.token_text(entry.token_id)] = _lp(entry.logprob)
        return top

    def completion_logprobs(
        self,
        res: _Result,
        job: _Job,
        echo: bool,
        offset0: int = 0,
        generated: list[TokenLogprob] | None = None,
        prompt_part: bool = True,
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if echo and prompt_part:
            plps = res.prompt_logprobs or []
            for i, tid in enumerate(res.prompt_ids):
                tokens.append(self.token_text(tid))
                entry = plps[i] if i < len(plps) else None
                token_lps.append(None if entry is None else _lp(entry.logprob))
                tops.append(None if entry is None else self.top_dict(entry))
        gen = res.logprobs if generated is None else generated
        if not job.drop_generated:
            for entry in gen:
                tokens.append(self.token_text(entry.token_id))
                token_lps.append(_lp(entry.logprob))
                tops.append(self.top_dict(entry))
        offsets = []
        pos = offset0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob], n: int) -> dict[str, Any]:
        content = []
        for e in entries:
            text = self.token_text(e.token_id)
            top = sorted(e.top.items(), key=lambda kv: kv[1], reverse=True)[:n]
            content.append(
                {
                    "token": text,
                    "logprob": _lp(e.logprob),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": (s := self.token_text(t)), "logprob": _lp(v), "bytes": list(s.encode())}
                        for t, v in top
                    ],
                }
            )
        return {"content": content}


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _stream_error(e: Exception) -> OpenAIError:
    """An error after the response started: sent as an SSE event (the status is already 200)."""
    return e if isinstance(e, OpenAIError) else _engine_error(e)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- app ------------------------------------------------------------------------------------------


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_model_len: int | None = None,
    root: str | None = None,
    manage_engine: bool = True,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app.

    With `manage_engine`, the app's lifespan starts the AsyncEngine's thread and shuts it down at
    exit. Bodies over `max_request_bytes` (default: the setting `serve_max_request_bytes`) get 413.
    """
    serving = OpenAIServing(async_engine, served_model_name, tokenizer, max_model_len, root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            if manage_engine:
                async_engine.shutdown()

    app = FastAPI(title="Kiln OpenAI-compatible server", lifespan=lifespan)
    app.state.serving = serving
    if max_request_bytes is None:
        from runtime.settings import get_settings

        max_request_bytes = get_settings().serve_max_request_bytes
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max_request_bytes,
        error_body=lambda message: OpenAIError(
            413, message + " (kiln serve --max-request-bytes)", code="request_too_large"
        ).body(),
    )

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return _error_response(OpenAIError(400, f"{param}: {msg}" if param else msg, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(_engine_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), type_=type_))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as pkg_version

        try:
            return {"version": pkg_version("kiln")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": serving.model_name,
                    "object": "model",
                    "created": serving.created,
                    "owned_by": "kiln",
                    "root": serving.root or serving.model_name,
                    "parent": None,
                    "max_model_len": serving.max_model_len,
                }
            ],
        }

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            ids = await serving.chat_prompt(messages, req.add_generation_prompt)
        else:
            encoding = await asyncio.to_thread(
                tokenizer, req.prompt, add_special_tokens=req.add_special_tokens
            )
            ids = list(encoding["input_ids"])
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        serving.check_model(req.model)
        if any(not 0 <= t < len(tokenizer) for t in req.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {len(tokenizer)})", param="tokens")
        return {"prompt": await serving.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """What a client needs to tokenize like the server (lm-evaluation-harness's remote tokenizer)."""
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": serving.max_model_len,
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await _completions(serving, req, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(serving, req, request)

    return app


def _check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    bad = req.unsupported()
    if bad is not None:
        raise OpenAIError(400, bad[1], param=bad[0])


async def _completions(s: OpenAIServing, req: CompletionRequest, request: Request) -> Response:
    s.check_model(req.model)
    _check_supported(req)
    prompts = await s.encode_prompts(req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError(400, "max_tokens=0 is only allowed with echo=true", param="max_tokens")
    rid = _new_id("cmpl")
    jobs = []
    for i, ids in enumerate(prompts):
        max_tokens = s.max_tokens_for(len(ids), req.max_tokens, 16, prompt_param="prompt")
        params = s.sampling(req, max(max_tokens, 1))
        params.echo = req.echo
        params.logprobs = req.logprobs
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        jobs.append(_Job(f"{rid}-{i}", ids, params, drop_generated=max_tokens == 0))
    if req.stream:
        merged = _merged(s, jobs)
        first = await anext(merged)  # submission errors are still a 4xx here, before the first byte
        return _sse_response(_completion_stream(s, req, rid, jobs, merged, first))
    try:
        results = await s.collect(request, jobs)
    except _Disconnected:
        return Response(status_code=499)
    choices = []
    for i, (job, res) in enumerate(zip(jobs, results, strict=True)):
        prompt_text = await s.decode(job.prompt_ids) if req.echo else ""
        gen_text = "" if job.drop_generated else res.text
        choices.append(
            {
                "index": i,
                "text": prompt_text + gen_text,
                "logprobs": s.completion_logprobs(res, job, req.echo) if req.logprobs is not None else None,
                "finish_reason": "length" if job.drop_generated else res.finish_reason,
                "stop_reason": None,
            }
        )
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": s.model_name,
            "choices": choices,
            "usage": _usage(results, jobs),
        }
    )


async def _merged(s: OpenAIServing, jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(job index, output) of several jobs as they arrive; every job is aborted if the consumer stops."""
    trackers = [s.metrics.track() for _ in jobs]
    streams = [s.outputs(job, t) for job, t in zip(jobs, trackers, strict=True)]
    try:
        firsts = [await anext(st) for st in streams]  # submission errors surface before any streaming
    except BaseException:
        for st in streams:
            await st.aclose()
        for t in trackers:
            t.finish("abort")
        raise
    if len(streams) == 1:
        try:
            yield 0, firsts[0]
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, firsts[i]))
            async for out in streams[i]:
                await queue.put((i, out))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
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
        for st in streams:
            await st.aclose()


def _sse_response(chunks: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _completion_stream(
    s: OpenAIServing,
    req: CompletionRequest,
    rid: str,
    jobs: list[_Job],
    merged: AsyncIterator[tuple[int, RequestOutput]],
    first: tuple[int, RequestOutput],
) -> AsyncIterator[bytes]:
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    results = [_Result(prompt_ids=j.prompt_ids) for j in jobs]
    offsets = [0] * len(jobs)
    echoed = [False] * len(jobs)

    def chunk(i: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> bytes:
        payload: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": s.model_name,
            "choices": [
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": None}
            ],
        }
        if include_usage:
            payload["usage"] = None
        return _sse(payload)

    async def items() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield first
        async for item in merged:
            yield item

    try:
        async for i, out in items():
            job, res = jobs[i], results[i]
            before = len(res.logprobs)
            res.add(out)
            text = "" if job.drop_generated else out.text_delta
            new_lps = res.logprobs[before:]
            prompt_part = False
            if req.echo and not echoed[i]:
                echoed[i] = True
                prompt_part = True
                text = await s.decode(job.prompt_ids) + text
            lp = None
            if req.logprobs is not None:
                lp = s.completion_logprobs(
                    res, job, req.echo, offsets[i], generated=new_lps, prompt_part=prompt_part
                )
                if lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            finish = None
            if out.finished:
                finish = "length" if job.drop_generated else out.finish_reason
            if text or finish or (lp and lp["tokens"]):
                yield chunk(i, text, lp, finish)
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": s.model_name,
                    "choices": [],
                    "usage": _usage(results, jobs),
                }
            )
    except Exception as e:
        yield _sse(_stream_error(e).body())
    finally:
        await merged.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


async def _chat(s: OpenAIServing, req: ChatCompletionRequest, request: Request) -> Response:
    s.check_model(req.model)
    _check_supported(req)
    prompt_ids = await s.chat_prompt(req.message_dicts(), req.add_generation_prompt)
    max_tokens = s.max_tokens_for(len(prompt_ids), req.max_new_tokens(), None)
    params = s.sampling(req, max_tokens)
    if req.logprobs:
        params.logprobs = req.top_logprobs or 0
    rid = _new_id("chatcmpl")
    job = _Job(rid, prompt_ids, params)
    if req.stream:
        outputs = s.outputs(job, s.metrics.track())
        first = await anext(outputs)  # submission errors are still a 4xx here, before the first byte
        return _sse_response(_chat_stream(s, req, rid, job, outputs, first))
    try:
        (res,) = await s.collect(request, [job])
    except _Disconnected:
        return Response(status_code=499)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": s.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": res.text},
                    "logprobs": s.chat_logprobs(res.logprobs, req.top_logprobs or 0)
                    if req.logprobs
                    else None,
                    "finish_reason": res.finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": _usage([res], [job]),
        }
    )


async def _chat_stream(
    s: OpenAIServing,
    req: ChatCompletionRequest,
    rid: str,
    job: _Job,
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    res = _Result(prompt_ids=job.prompt_ids)

    def chunk(
        delta: dict[str, Any], finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        payload: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": s.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = _usage([res], [job]) if continuous else None
        return _sse(payload)

    try:
        yield chunk({"role": "assistant", "content": ""})
        pending: list[RequestOutput] = [first]
        while True:
            out = pending.pop() if pending else await anext(outputs)
            before = len(res.logprobs)
            res.add(out)
            lps = s.chat_logprobs(res.logprobs[before:], req.top_logprobs or 0) if req.logprobs else None
            has_lps = bool(lps and lps["content"])
            if out.text_delta or has_lps:
                yield chunk({"content": out.text_delta}, logprobs=lps)
            if out.finished:
                yield chunk({}, finish=out.finish_reason)
                break
        if include_usage:
            yield _sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": s.model_name,
                    "choices": [],
                    "usage": _usage([res], [job]),
                }
            )
    except StopAsyncIteration:
        pass
    except Exception as e:
        yield _sse(_stream_error(e).body())
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
