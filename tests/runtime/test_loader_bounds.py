"""A manifest claiming an absurd model (10^7 decoder layers, a dimension far past its tensors) is
refused by `kiln generate` before anything is built from it: quickly, in no more memory than loading
the real tiny model takes, naming the field. A manifest over MAX_MANIFEST_BYTES is refused unparsed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import copy_artifact, edit_manifest
from runtime.artifact.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from runtime.artifact.pull import verify_local
from runtime.loader import load_model

# Runs `kiln` (services.cli:main) and reports the process's peak RSS on stderr, however it exits.
KILN_WITH_PEAK_RSS = """
import resource, sys
from services.cli import main
try:
    main()
finally:
    sys.stderr.write(f"\\npeak_rss_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n")
"""
# Refusing may cost what loading the real tiny model costs, plus this (the tiny model's weights are
# under 2 MB; the 10^7-layer manifest drove the loader past 5 GB before the fix).
RSS_MARGIN_KB = 64 << 10
REFUSAL_SECONDS = 120  # the subprocess's limit: a refusal takes seconds (imports), the old path minutes


def _generate(artifact: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            KILN_WITH_PEAK_RSS,
            "generate",
            str(artifact),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=REFUSAL_SECONDS,
    )
    peak = [line for line in r.stderr.splitlines() if line.startswith("peak_rss_kb=")]
    assert peak, r.stderr[-2000:]
    return r, int(peak[-1].split("=")[1])


@pytest.fixture(scope="module")
def loading_peak_kb(llama_artifact: tuple[PreTrainedModel, Path]) -> int:
    """Peak RSS of `kiln generate` loading the real tiny model and generating one token."""
    ok, peak_kb = _generate(llama_artifact[1])
    assert ok.returncode == 0, ok.stderr[-2000:]
    return peak_kb


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_hidden_layers", 10**7, r"num_hidden_layers = 10000000: must be an integer in \[1, 4096\]"),
        ("num_hidden_layers", 4000, r"num_hidden_layers = 4000, but the manifest's layers belong to 2"),
        ("intermediate_size", 1 << 20, r"gate_up_proj: .*gives N=2097152.* intermediate_size = 1048576"),
        ("vocab_size", 1 << 22, r"vocab_size = 4194304, .* hold it as \(259, 128\)"),
    ],
)
def test_a_manifest_claiming_a_huge_model_is_refused_in_little_memory(
    tmp_path: Path,
    llama_artifact: tuple[PreTrainedModel, Path],
    loading_peak_kb: int,
    key: str,
    value: int,
    message: str,
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    edit_manifest(art, lambda doc: doc["hf_config"].update({key: value}))
    r, peak_kb = _generate(art)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")], r.stderr[-2000:]
    assert re.search(message, r.stderr), r.stderr[-2000:]
    assert peak_kb < loading_peak_kb + RSS_MARGIN_KB, (
        f"refusing peaked at {peak_kb} kB, loading the real model at {loading_peak_kb} kB"
    )


def test_a_manifest_over_the_size_limit_is_refused_unparsed(
    tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    art = copy_artifact(llama_artifact[1], tmp_path)
    raw = (art / MANIFEST_NAME).read_bytes()
    padded = raw + b" " * (MAX_MANIFEST_BYTES + 1 - len(raw))  # still valid JSON
    (art / MANIFEST_NAME).write_bytes(padded)
    for refuse in (load_model, verify_local):
        with pytest.raises(
            ManifestError, match=rf"{MAX_MANIFEST_BYTES + 1} bytes, over the {MAX_MANIFEST_BYTES}-byte"
        ):
            refuse(art)
    with pytest.raises(ManifestError, match="over the"):
        Manifest.parse(padded)
    (art / MANIFEST_NAME).write_bytes(padded[:MAX_MANIFEST_BYTES])  # at the limit: accepted
    assert load_model(art, with_tokenizer=False).manifest.artifact_id == art.name
