"""The tokenizer shipped inside an artifact (copied from the source checkpoint), loaded offline,
and incremental detokenization that never emits half of a multi-byte character.

`load_tokenizer` reads `tokenizer.json` with the `tokenizers` library and renders the chat template
with jinja2 (`ArtifactTokenizer`): importing transformers costs seconds and ≈200 MB, most of a cold
start. It keeps the slice of transformers' tokenizer API the runtime uses (`__call__`, `decode`,
`convert_ids_to_tokens`, `convert_tokens_to_string`, `apply_chat_template`, the special tokens).
Artifacts without `tokenizer.json` (SentencePiece-only sources) fall back to transformers'
`AutoTokenizer`. Either way only the files the artifact's manifest lists are read, each checked
against it (runtime/artifact/listed_files.py).
"""

from __future__ import annotations

import json
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from kernels.errors import KilnError
from runtime.artifact.listed_files import ListedFiles
from runtime.artifact.manifest import Manifest

REPLACEMENT_CHAR = "\ufffd"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(KilnError):
    """The artifact has no usable tokenizer files."""


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateRaise(message)


class TemplateRaise(ValueError):
    """`raise_exception(...)` called by a chat template (transformers raises TemplateError)."""


class ArtifactTokenizer:
    """A `tokenizers.Tokenizer` plus the tokenizer_config.json facts transformers would add."""

    def __init__(self, tokenizer: Any, config: dict[str, Any], chat_template: str | None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.config = config
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = (
            _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES
        )
        self.eos_token_id = self._id(self.eos_token)
        self.bos_token_id = self._id(self.bos_token)
        self.pad_token_id = self._id(self.pad_token)
        self._template: Any = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def __len__(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    # The batch calls release the GIL (the single ones hold it): a server thread tokenizing a long
    # prompt does not stall the event loop.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0])

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tok.decoder
        return str(decoder.decode(tokens)) if decoder is not None else "".join(tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render like transformers: sandboxed jinja2, trim_blocks + lstrip_blocks, loop controls."""
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        special = {name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES}
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_chat_template(files: ListedFiles, config: dict[str, Any]) -> str | None:
    jinja = files.text("chat_template.jinja")
    if jinja is not None:
        return jinja
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(artifact_dir: Path, manifest: Manifest | None = None) -> Any:
    """The artifact's tokenizer, from the files its manifest lists only (each checked against the
    manifest; runtime/artifact/listed_files.py): `ArtifactTokenizer` from tokenizer.json, else
    transformers' from a directory holding just the listed files."""
    artifact_dir = Path(artifact_dir)
    files = ListedFiles(artifact_dir, manifest or Manifest.load(artifact_dir))
    tokenizer_json = files.text("tokenizer.json")
    if tokenizer_json is not None:
        from tokenizers import Tokenizer

        config = files.json_object("tokenizer_config.json") or {}
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises plain Exception on bad JSON
            raise TokenizerError(
                f"{artifact_dir / 'tokenizer.json'}: cannot load the tokenizer ({e}); "
                "re-convert the checkpoint"
            ) from e
        return ArtifactTokenizer(tokenizer, config, _read_chat_template(files, config))
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="kiln-tokenizer-") as listed_only:
        files.copy_into(Path(listed_only))
        try:
            return AutoTokenizer.from_pretrained(listed_only, local_files_only=True)
        except (OSError, ValueError) as e:
            raise TokenizerError(
                f"{artifact_dir}: cannot load the tokenizer ({e}); the artifact's manifest must list "
                "the source's tokenizer files (tokenizer.json / tokenizer_config.json) — re-convert "
                "the checkpoint"
            ) from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens twice (without and with the new ones) and emits the
    difference, holding it back while it ends in U+FFFD (an incomplete UTF-8 sequence split across
    byte-level tokens). Decoding a window rather than only the new token keeps tokenizers that add
    spaces depending on the preceding token (SentencePiece) correct.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], window: int = 6) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
