"""Chat formatting with the tokenizer's own chat template (the one copied from the source checkpoint)."""

from __future__ import annotations

from typing import Any

from kernels.errors import KilnError


class ChatTemplateError(KilnError):
    """The messages cannot be formatted (no template, or the template rejected them): a 400."""


def apply_chat_template(
    tokenizer: Any,  # runtime.tokenizer.ArtifactTokenizer or a transformers tokenizer
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the formatted conversation, ready for the engine."""
    from jinja2 import TemplateError  # here: a plain prompt's first token does not wait for jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; use /v1/completions (or --no-chat) instead"
        )
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e
    assert isinstance(text, str)
    # The template already wrote any BOS it wants; don't let the tokenizer add a second one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
