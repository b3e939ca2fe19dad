"""The tokenizer shipped inside an artifact (copied from the source checkpoint), loaded offline,
and incremental detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kernels.errors import KilnError

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(KilnError):
    """The artifact has no usable tokenizer files."""


def load_tokenizer(artifact_dir: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(str(artifact_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerError(
            f"{artifact_dir}: cannot load the tokenizer ({e}); the artifact must contain the source's "
            "tokenizer files (tokenizer.json / tokenizer_config.json) — re-convert the checkpoint"
        ) from e


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of recent tokens twice (without and with the new ones) and emits the
    difference, holding it back while it ends in U+FFFD (an incomplete UTF-8 sequence split across
    byte-level tokens). Decoding a window rather than only the new token keeps tokenizers that add
    spaces depending on the preceding token (SentencePiece) correct.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], window: int = 6) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
