"""What one `kiln serve` client may ask for: the caps on request sizes, checked before any work.

A request over a cap is a 400 naming the field and the cap; nothing here is tokenized, rendered or
searched before it passed. The body itself is capped in bytes (`serve_max_request_bytes`), the
prompt in characters before tokenizing (at most `PROMPT_CHARS_PER_TOKEN` characters per token of
context: no tokenizer's token stands for more, so a longer prompt could never fit), the chat
messages in count, the stop strings in count and length (each is searched at every token), the
`stop_token_ids` in count, the prompts of one request and their token ids in number, and the ids
to detokenize in number (the last three in the request schema, runtime/openai/protocol.py).
"""

from __future__ import annotations

from kernels.errors import KilnError

PROMPT_CHARS_PER_TOKEN = 32
MAX_CHAT_MESSAGES = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_DETOKENIZE_IDS = 1 << 17
MAX_PROMPT_IDS = 1 << 20  # one token-id prompt (the context check then applies)
MAX_PROMPTS = 256  # prompts in one completions request


class InvalidRequestError(KilnError):
    """A request's parameters are invalid; the server answers 400 with this message, naming the
    field `param` when one is at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLargeError(InvalidRequestError):
    """A request over one of the caps: a 400 naming the field (`param`) and the cap."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


def max_prompt_chars(max_model_len: int) -> int:
    return max_model_len * PROMPT_CHARS_PER_TOKEN


def check_prompt_chars(texts: list[str], max_model_len: int, param: str) -> None:
    """Each prompt (or the rendered messages) within what the context could hold."""
    cap = max_prompt_chars(max_model_len)
    for text in texts:
        if len(text) > cap:
            raise RequestTooLargeError(
                f"{param} has {len(text)} characters; this server takes at most {cap} "
                f"({PROMPT_CHARS_PER_TOKEN} per token of its {max_model_len}-token context)",
                param,
            )


def check_messages(contents: list[str], max_model_len: int) -> None:
    """Chat messages: at most MAX_CHAT_MESSAGES, their text together within the prompt cap."""
    if len(contents) > MAX_CHAT_MESSAGES:
        raise RequestTooLargeError(
            f"messages has {len(contents)} entries; this server takes at most {MAX_CHAT_MESSAGES}",
            "messages",
        )
    check_prompt_chars(["".join(contents)], max_model_len, "messages")


def check_stop(stop: list[str], stop_token_ids: list[int]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestTooLargeError(
            f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise RequestTooLargeError(
            f"a stop string has {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed", "stop"
        )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestTooLargeError(
            f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
            "stop_token_ids",
        )
