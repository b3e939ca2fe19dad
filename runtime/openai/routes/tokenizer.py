"""vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (lm-evaluation-harness tokenizes
through them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from runtime.openai.errors import OpenAIError
from runtime.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from runtime.openai.routes import serving_of

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> TokenizeResponse:
    serving = serving_of(request)
    serving.check_model(req.model)
    if req.messages is not None and req.prompt is None:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = await serving.chat_prompt(messages, req.add_generation_prompt)
    elif req.prompt is not None and req.messages is None:
        ids = await serving.encode(req.prompt, req.add_special_tokens)
    else:
        raise OpenAIError(400, "send exactly one of `prompt` and `messages`", param="prompt")
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    serving = serving_of(request)
    serving.check_model(req.model)
    vocab = len(serving.tokenizer)
    if req.tokens and not 0 <= min(req.tokens) <= max(req.tokens) < vocab:
        raise OpenAIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await serving.decode(req.tokens))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> TokenizerInfoResponse:
    serving = serving_of(request)
    tokenizer = serving.tokenizer
    return TokenizerInfoResponse(
        tokenizer_class=type(tokenizer).__name__,
        eos_token=tokenizer.eos_token,
        bos_token=tokenizer.bos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=serving.max_model_len,
    )
