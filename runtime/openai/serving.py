"""What the completion and chat endpoints share: the model check, tokenization off the event loop,
sampling parameters, and the engine plumbing (submit every job of a request, abort all on failure,
disconnect or early close).

The handlers only tokenize, validate and format: prefill and decode run in the AsyncEngine's thread,
and tokenization / chat templating / detokenizing a whole prompt run in a worker thread, so a large
prompt never stalls the event loop (health checks, other streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from fastapi import Request

from runtime import request_limits as limits
from runtime.chat import ChatTemplateError, apply_chat_template
from runtime.engine import AsyncEngine, ContextLengthError, RequestOutput, resolve_max_tokens
from runtime.metrics import RequestTracker, ServerMetrics
from runtime.openai.errors import OpenAIError, context_error, engine_error
from runtime.openai.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo
from runtime.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


class Disconnected(Exception):
    """The HTTP client went away before the response was complete."""


def clamp_logprob(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenTexts:
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


@dataclass
class Job:
    """One engine request: id, prompt, params, and how the server post-processes it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drop_generated: bool = False  # max_tokens=0 with echo: the engine generates one token, not shown


@dataclass
class Result:
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


def usage(results: Sequence[Result], jobs: Sequence[Job]) -> UsageInfo:
    prompt = completion = 0
    for res, job in zip(results, jobs, strict=True):
        prompt += len(res.prompt_ids)
        completion += 0 if job.drop_generated else len(res.token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Submitted(NamedTuple):
    """A job the engine accepted: its first output, and the stream of the rest (closing it early
    aborts the request)."""

    first: RequestOutput
    rest: AsyncGenerator[RequestOutput, None]


def _message_text(message: dict[str, Any]) -> str:
    """What a chat message adds to the rendered prompt, as the prompt cap counts it."""
    content = message.get("content")
    return content if isinstance(content, str) else str(content or "")


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
        self.max_model_len: int = max_model_len or engine.engine.max_model_len
        self.root = root
        self.created = int(time.time())
        self.token_text = TokenTexts(tokenizer)
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

    def check_request(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The model exists and every field that is set is implemented."""
        self.check_model(req.model)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, bad[1], param=bad[0])

    def max_tokens(
        self, prompt_len: int, requested: int | None, default: int | None, prompt_param: str
    ) -> int:
        """The engine's context check (see `resolve_max_tokens`) under this server's context limit."""
        try:
            return resolve_max_tokens(prompt_len, requested, default, self.max_model_len)
        except ContextLengthError as e:
            raise context_error(e, prompt_param) from e

    @staticmethod
    def sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        return SamplingParams(
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

    # --- tokenizer, off the event loop ------------------------------------------------------------

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
            limits.check_prompt_chars(texts, self.max_model_len, "prompt")
            tokenizer = self.tokenizer
            batch = await asyncio.to_thread(lambda: [list(tokenizer(t)["input_ids"]) for t in texts])
        return batch

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        limits.check_prompt_chars([text], self.max_model_len, "prompt")
        encoding = await asyncio.to_thread(self.tokenizer, text, add_special_tokens=add_special_tokens)
        return list(encoding["input_ids"])

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The chat template applied and tokenized."""
        limits.check_messages([_message_text(m) for m in messages], self.max_model_len)
        try:
            return await asyncio.to_thread(
                apply_chat_template, self.tokenizer, messages, add_generation_prompt=add_generation_prompt
            )
        except ChatTemplateError as e:
            raise OpenAIError(400, str(e), param="messages") from e

    async def decode(self, ids: list[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode, ids)

    def top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        """A position's top-n tokens *and* the actual token, by display string."""
        top = {self.token_text(t): clamp_logprob(v) for t, v in entry.top.items()}
        top[self.token_text(entry.token_id)] = clamp_logprob(entry.logprob)
        return top

    # --- engine plumbing ----------------------------------------------------------------------------

    async def submit(self, jobs: Sequence[Job]) -> list[Submitted]:
        """Submit every job and wait for each one's first output, so that a bad job fails the whole
        request (as a 4xx, before any response byte) before the others run for long. On failure every
        job is aborted."""
        trackers = [self.metrics.track() for _ in jobs]
        streams = [self._outputs(job, t) for job, t in zip(jobs, trackers, strict=True)]
        try:
            firsts = [await anext(st) for st in streams]
        except BaseException:
            for st in streams:
                await st.aclose()
            for t in trackers:
                t.finish("abort")
            raise
        return [Submitted(first, st) for first, st in zip(firsts, streams, strict=True)]

    async def collect(self, request: Request, jobs: Sequence[Job]) -> list[Result]:
        """Run jobs concurrently to completion; abort all of them if the client disconnects."""
        submitted = await self.submit(jobs)
        results = [Result(prompt_ids=j.prompt_ids) for j in jobs]

        async def drain(res: Result, sub: Submitted) -> None:
            res.add(sub.first)
            async for out in sub.rest:
                res.add(out)

        work = asyncio.ensure_future(
            asyncio.gather(*(drain(r, s) for r, s in zip(results, submitted, strict=True)))
        )
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise Disconnected
            work.result()
        finally:
            watcher.cancel()
            if not work.done():
                # Cancelling the drains closes their output streams, which aborts the requests.
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            for sub in submitted:
                await sub.rest.aclose()
        return results

    async def _start(
        self, job: Job, tracker: RequestTracker
    ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Submit a job and wait for its first output. Returns the iterator and that first output."""
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
            raise engine_error(e) from e
        tracker.tokens(len(first.new_token_ids))
        return it, first

    async def _outputs(self, job: Job, tracker: RequestTracker) -> AsyncGenerator[RequestOutput, None]:
        """All outputs of a job, the first included. Closing this iterator early aborts the request."""
        it, first = await self._start(job, tracker)
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
                self._abort(job.request_id)
                tracker.finish("abort")
            elif not tracker.done:
                tracker.finish(first.finish_reason)
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # aborting a finished or unknown request is not an error worth surfacing
            log.debug("abort(%s) failed", request_id, exc_info=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
