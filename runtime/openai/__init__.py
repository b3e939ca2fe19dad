"""OpenAI-compatible HTTP server over the AsyncEngine (`kiln serve`), laid out like vLLM's
`entrypoints/openai`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE streaming with
`stream_options.include_usage`), GET /health, GET /metrics (Prometheus, vLLM's metric names),
GET /version, and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info (which let
lm-evaluation-harness tokenize through the server). A client that disconnects (streaming or not) has
its requests aborted, which frees their slots.

    app.py          build_app: the FastAPI app, lifespan, error handlers, middleware
    routes/         the routers: operations (health, version, metrics, models), tokenizer, generation
    protocol.py     request and response bodies (pydantic)
    errors.py       OpenAI's error body and the mapping of exceptions to it
    serving.py      OpenAIServing: validation, tokenization, engine plumbing shared by the endpoints
    completions.py  /v1/completions
    chat.py         /v1/chat/completions
    streaming.py    SSE framing and the merged stream of several jobs
"""

from runtime.openai.app import build_app

__all__ = ["build_app"]
