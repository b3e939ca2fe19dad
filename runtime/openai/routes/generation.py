"""POST /v1/completions and POST /v1/chat/completions (completions.py and chat.py do the work)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from runtime.openai.chat import create_chat_completion
from runtime.openai.completions import create_completion
from runtime.openai.protocol import ChatCompletionRequest, CompletionRequest
from runtime.openai.routes import serving_of

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(req: CompletionRequest, request: Request) -> Response:
    return await create_completion(serving_of(request), req, request)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(serving_of(request), req, request)
