"""POST /v1/completions: one engine job per prompt, answered whole or streamed.

With `echo` + `logprobs` the response holds prompt log-likelihoods the way lm-evaluation-harness's
`local-completions` reads them: `logprobs.tokens`, `token_logprobs` (first entry null),
`top_logprobs` (a dict per position holding the top-n tokens *and* the actual token, first entry
null) and `text_offset`. `max_tokens=0` with echo returns the prompt alone.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.openai.errors import OpenAIError
from runtime.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from runtime.openai.serving import Disconnected, Job, OpenAIServing, Result, clamp_logprob, new_id, usage
from runtime.openai.streaming import SSE_DONE, Indexed, merged, sse_error, sse_event, sse_response
from runtime.sampling import TokenLogprob

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def create_completion(s: OpenAIServing, req: CompletionRequest, request: Request) -> Response:
    s.check_request(req)
    prompts = await s.encode_prompts(req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError(400, "max_tokens=0 is only allowed with echo=true", param="max_tokens")
    rid = new_id("cmpl")
    jobs = []
    for i, ids in enumerate(prompts):
        max_tokens = s.max_tokens(len(ids), req.max_tokens, DEFAULT_MAX_TOKENS, prompt_param="prompt")
        params = s.sampling(req, max(max_tokens, 1))
        params.echo = req.echo
        params.logprobs = req.logprobs
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        jobs.append(Job(f"{rid}-{i}", ids, params, drop_generated=max_tokens == 0))
    if req.stream:
        submitted = await s.submit(jobs)  # submission errors are still a 4xx here, before the first byte
        return sse_response(_stream(s, req, rid, jobs, merged(submitted)))
    try:
        results = await s.collect(request, jobs)
    except Disconnected:
        return Response(status_code=499)
    choices = []
    for i, (job, res) in enumerate(zip(jobs, results, strict=True)):
        prompt_text = await s.decode(job.prompt_ids) if req.echo else ""
        gen_text = "" if job.drop_generated else res.text
        choices.append(
            CompletionChoice(
                index=i,
                text=prompt_text + gen_text,
                logprobs=logprobs(s, res, job, req.echo) if req.logprobs is not None else None,
                finish_reason="length" if job.drop_generated else res.finish_reason,
            )
        )
    body = CompletionResponse(
        id=rid, created=int(time.time()), model=s.model_name, choices=choices, usage=usage(results, jobs)
    )
    return JSONResponse(body.model_dump())


def logprobs(
    s: OpenAIServing,
    res: Result,
    job: Job,
    echo: bool,
    offset0: int = 0,
    generated: list[TokenLogprob] | None = None,
    prompt_part: bool = True,
) -> CompletionLogprobs:
    """The prompt's logprobs (with echo, when `prompt_part`) and then those of `generated` (default:
    everything generated so far); text offsets count from `offset0`."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echo and prompt_part:
        plps = res.prompt_logprobs or []
        for i, tid in enumerate(res.prompt_ids):
            tokens.append(s.token_text(tid))
            entry = plps[i] if i < len(plps) else None
            token_lps.append(None if entry is None else clamp_logprob(entry.logprob))
            tops.append(None if entry is None else s.top_dict(entry))
    if not job.drop_generated:
        for entry in res.logprobs if generated is None else generated:
            tokens.append(s.token_text(entry.token_id))
            token_lps.append(clamp_logprob(entry.logprob))
            tops.append(s.top_dict(entry))
    offsets = []
    pos = offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops, text_offset=offsets)


async def _stream(
    s: OpenAIServing,
    req: CompletionRequest,
    rid: str,
    jobs: list[Job],
    outputs: AsyncGenerator[Indexed, None],
) -> AsyncIterator[bytes]:
    created = int(time.time())
    exclude = None if req.include_usage else {"usage"}
    results = [Result(prompt_ids=j.prompt_ids) for j in jobs]
    offsets = [0] * len(jobs)
    echoed = [False] * len(jobs)

    def chunk(choice: CompletionChoice) -> bytes:
        return sse_event(
            CompletionStreamResponse(id=rid, created=created, model=s.model_name, choices=[choice]), exclude
        )

    try:
        async for i, out in outputs:
            job, res = jobs[i], results[i]
            before = len(res.logprobs)
            res.add(out)
            text = "" if job.drop_generated else out.text_delta
            prompt_part = False
            if req.echo and not echoed[i]:
                echoed[i] = True
                prompt_part = True
                text = await s.decode(job.prompt_ids) + text
            lp = None
            if req.logprobs is not None:
                lp = logprobs(s, res, job, req.echo, offsets[i], res.logprobs[before:], prompt_part)
                if lp.tokens:
                    offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
            finish = None
            if out.finished:
                finish = "length" if job.drop_generated else out.finish_reason
            if text or finish or (lp is not None and lp.tokens):
                yield chunk(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish))
        if req.include_usage:
            final = CompletionStreamResponse(
                id=rid, created=created, model=s.model_name, choices=[], usage=usage(results, jobs)
            )
            yield sse_event(final)
    except Exception as e:
        yield sse_error(e)
    finally:
        await outputs.aclose()
    yield SSE_DONE
