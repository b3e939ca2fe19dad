"""kiln serve's routes, one router per concern (as the REST API's `services/api/routes`); each reads
the app's `OpenAIServing` from `request.app.state.serving` (`serving_of`)."""

from __future__ import annotations

from fastapi import Request

from runtime.openai.serving import OpenAIServing


def serving_of(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.serving
    return serving
