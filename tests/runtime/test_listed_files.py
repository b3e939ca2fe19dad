"""Only the files an artifact's manifest lists are ever read (tokenizer files, chat template,
generation_config.json), each checked against its size and sha256 on every load; a listed file that
is malformed is a one-line error from `kiln generate`, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import EOS_ID, copy_artifact, edit_manifest, list_file, unlist_file
from runtime.artifact.listed_files import ListedFileError
from runtime.chat import ChatTemplateError, apply_chat_template
from runtime.loader import load_model
from runtime.tokenizer import TokenizerError

MARKER_TEMPLATE = "UNLISTED-TEMPLATE {{ messages[0]['content'] }}"


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `kiln` command of this environment."""
    exe = Path(sys.executable).with_name("kiln")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=os.environ)


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_an_unlisted_chat_template_is_never_rendered(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    (art / "chat_template.jinja").write_text(MARKER_TEMPLATE)
    unlist_file(art, "chat_template.jinja")
    tokenizer = load_model(art).tokenizer
    assert tokenizer.chat_template is None  # tokenizer_config.json has none, the file is not read
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def test_a_listed_file_edited_in_place_is_refused_at_load(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    (art / "chat_template.jinja").write_text(MARKER_TEMPLATE)
    with pytest.raises(ListedFileError, match=r"chat_template\.jinja: .* the file was altered"):
        load_model(art)


def test_a_listed_chat_template_is_rendered(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    list_file(art, "chat_template.jinja", MARKER_TEMPLATE.encode())
    tokenizer = load_model(art).tokenizer
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids).startswith("UNLISTED-TEMPLATE hi")


def test_an_unlisted_generation_config_is_not_read(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    (art / "generation_config.json").write_text("[1, 2]")
    unlist_file(art, "generation_config.json")
    assert load_model(art).eos_token_ids == (EOS_ID,)


def test_a_listed_generation_config_adds_its_eos_ids(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    list_file(art, "generation_config.json", b'{"eos_token_id": [258, 7], "temperature": 0.6}')
    assert load_model(art).eos_token_ids == (7, EOS_ID)


MALFORMED_GENERATION_CONFIGS = {
    "a list": (b"[1, 2]", r"generation_config\.json: expected a JSON object, got list"),
    "not JSON": (b"{", r"generation_config\.json: not valid JSON"),
    "eos text": (b'{"eos_token_id": "x"}', r"generation_config\.json: eos_token_id = x: must be a token id"),
    "eos negative": (b'{"eos_token_id": [2, -1]}', r"eos_token_id = \[2, -1\]"),
    "not UTF-8": (b'{"eos_token_id": "\xff"}', r"generation_config\.json: not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_GENERATION_CONFIGS))
def test_a_listed_malformed_generation_config_is_a_clear_error(
    case: str, tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    payload, message = MALFORMED_GENERATION_CONFIGS[case]
    art = copy_artifact(llama_artifact[1], tmp_path)
    list_file(art, "generation_config.json", payload)
    with pytest.raises(ListedFileError, match=message):
        load_model(art)


def test_kiln_generate_verify_on_a_malformed_generation_config_prints_one_line(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    list_file(art, "generation_config.json", b"[1, 2]")
    r = kiln("generate", str(art), "--prompt", "hi", "--max-tokens", "1", "--verify")
    assert_one_line_error(r, "generation_config.json: expected a JSON object, got list")


def test_kiln_generate_verify_on_a_nan_manifest_prints_one_line(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    edit_manifest(art, lambda doc: doc["hf_config"].update(rms_norm_eps=float("nan")))
    r = kiln("generate", str(art), "--prompt", "hi", "--max-tokens", "1", "--verify")
    assert_one_line_error(r, "hf_config.rms_norm_eps = nan")


def test_an_unlisted_tokenizer_is_not_loaded(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    """With tokenizer.json off the list, the fallback sees only the listed files: no tokenizer."""
    art = copy_artifact(llama_artifact[1], tmp_path)
    unlist_file(art, "tokenizer.json")
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        load_model(art)


def test_a_fifo_in_place_of_a_listed_file_is_refused_not_waited_on(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    (art / "chat_template.jinja").unlink()
    os.mkfifo(art / "chat_template.jinja")
    with pytest.raises(ListedFileError, match=r"chat_template\.jinja: cannot be read \(not a regular file\)"):
        load_model(art)
