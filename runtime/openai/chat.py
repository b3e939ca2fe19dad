"""POST /v1/chat/completions: the messages formatted with the model's chat template, one engine job,
answered whole or streamed (a role chunk, content chunks, a finish chunk, then usage with
`stream_options.include_usage`, or usage on every chunk with `continuous_usage_stats`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.engine import RequestOutput
from runtime.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
)
from runtime.openai.serving import (
    Disconnected,
    Job,
    OpenAIServing,
    Result,
    Submitted,
    clamp_logprob,
    new_id,
    usage,
)
from runtime.openai.streaming import SSE_DONE, sse_error, sse_event, sse_response
from runtime.sampling import TokenLogprob


async def create_chat_completion(s: OpenAIServing, req: ChatCompletionRequest, request: Request) -> Response:
    s.check_request(req)
    prompt_ids = await s.chat_prompt(req.message_dicts(), req.add_generation_prompt)
    max_tokens = s.max_tokens(len(prompt_ids), req.max_new_tokens(), None, prompt_param="messages")
    params = s.sampling(req, max_tokens)
    if req.logprobs:
        params.logprobs = req.top_logprobs or 0
    rid = new_id("chatcmpl")
    job = Job(rid, prompt_ids, params)
    if req.stream:
        (submitted,) = await s.submit([job])  # submission errors are still a 4xx here, before the first byte
        return sse_response(_stream(s, req, rid, job, submitted))
    try:
        (res,) = await s.collect(request, [job])
    except Disconnected:
        return Response(status_code=499)
    choice = ChatCompletionChoice(
        index=0,
        message=ChatResponseMessage(content=res.text),
        logprobs=logprobs(s, res.logprobs, req.top_logprobs or 0) if req.logprobs else None,
        finish_reason=res.finish_reason,
    )
    body = ChatCompletionResponse(
        id=rid, created=int(time.time()), model=s.model_name, choices=[choice], usage=usage([res], [job])
    )
    return JSONResponse(body.model_dump())


def logprobs(s: OpenAIServing, entries: list[TokenLogprob], n: int) -> ChatLogprobs:
    """The chosen token of each entry with its `n` most likely alternatives."""
    content = []
    for e in entries:
        text = s.token_text(e.token_id)
        top = sorted(e.top.items(), key=lambda kv: kv[1], reverse=True)[:n]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=clamp_logprob(e.logprob),
                bytes=list(text.encode()),
                top_logprobs=[
                    ChatTopLogprob(
                        token=(t := s.token_text(tid)), logprob=clamp_logprob(v), bytes=list(t.encode())
                    )
                    for tid, v in top
                ],
            )
        )
    return ChatLogprobs(content=content)


async def _stream(
    s: OpenAIServing,
    req: ChatCompletionRequest,
    rid: str,
    job: Job,
    submitted: Submitted,
) -> AsyncIterator[bytes]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}
    continuous = req.continuous_usage
    res = Result(prompt_ids=job.prompt_ids)

    def chunk(delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None) -> bytes:
        choice = ChatCompletionStreamChoice(index=0, delta=delta, logprobs=lps, finish_reason=finish)
        body = ChatCompletionStreamResponse(
            id=rid,
            created=created,
            model=s.model_name,
            choices=[choice],
            usage=usage([res], [job]) if continuous else None,
        )
        return sse_event(body, exclude)

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        out: RequestOutput | None = submitted.first
        while out is not None:
            before = len(res.logprobs)
            res.add(out)
            lps = logprobs(s, res.logprobs[before:], req.top_logprobs or 0) if req.logprobs else None
            if out.text_delta or (lps is not None and lps.content):
                yield chunk(DeltaMessage(content=out.text_delta), lps=lps)
            if out.finished:
                yield chunk(DeltaMessage(), finish=out.finish_reason)
                if req.include_usage:
                    final = ChatCompletionStreamResponse(
                        id=rid, created=created, model=s.model_name, choices=[], usage=usage([res], [job])
                    )
                    yield sse_event(final)
                break
            out = await anext(submitted.rest, None)
    except Exception as e:
        yield sse_error(e)
    finally:
        await submitted.rest.aclose()
    yield SSE_DONE
