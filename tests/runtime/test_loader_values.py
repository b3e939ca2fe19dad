"""Every value of a manifest's model config is checked when the artifact is loaded, before any file is
mapped: of its type, finite, in range and consistent (head counts dividing, rope computable), and the
error names the field and the value. The rank file is deleted from each tampered copy, so a refusal
naming the field (and not the missing file) shows that nothing was mapped first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import copy_artifact, edit_manifest
from kernels.errors import KilnError
from runtime.artifact.manifest import ManifestError
from runtime.loader import load_model
from runtime.model_layout import ModelConfigError

Edit = Callable[[dict[str, Any]], None]


def _config(key: str, value: object) -> Edit:
    return lambda doc: doc["hf_config"].__setitem__(key, value)


def _rope(key: str, value: object) -> Edit:
    return lambda doc: doc["hf_config"]["rope_parameters"].__setitem__(key, value)


NAN, INF = float("nan"), float("inf")
# (edit, error class, what the message must say: the field and its value)
CASES: dict[str, tuple[Edit, type[KilnError], str]] = {
    "rms_norm_eps NaN": (_config("rms_norm_eps", NAN), ManifestError, r"hf_config\.rms_norm_eps = nan"),
    "rms_norm_eps 0": (_config("rms_norm_eps", 0), ModelConfigError, r"rms_norm_eps = 0: .*\(0, 1\)"),
    "rms_norm_eps 1": (_config("rms_norm_eps", 1.0), ModelConfigError, r"rms_norm_eps = 1\.0: "),
    "rms_norm_eps negative": (_config("rms_norm_eps", -1e-5), ModelConfigError, r"rms_norm_eps = -1e-05"),
    "rms_norm_eps text": (_config("rms_norm_eps", "1e-5"), ModelConfigError, r"rms_norm_eps = '1e-5'"),
    "rope_theta inf": (_rope("rope_theta", INF), ManifestError, r"rope_parameters\.rope_theta = inf"),
    "rope_theta 0": (_rope("rope_theta", 0), ModelConfigError, r"rope_theta = 0: "),
    "rope_theta huge": (_rope("rope_theta", 1e300), ModelConfigError, r"rope_theta = 1e\+300"),
    "rope factor negative": (_rope("factor", -8.0), ModelConfigError, r"factor = -8\.0"),
    "rope low >= high": (
        _rope("low_freq_factor", 4.0),
        ModelConfigError,
        r"high_freq_factor = 4\.0: must exceed",
    ),
    "rope original context 0": (
        _rope("original_max_position_embeddings", 0),
        ModelConfigError,
        r"original_max_position_embeddings = 0",
    ),
    "rope kind unknown": (
        _rope("rope_type", "longrope"),
        KilnError,
        r"rope_scaling type 'longrope' is not supported",
    ),
    "heads not dividing hidden": (
        _config("num_attention_heads", 3),
        ModelConfigError,
        r"num_attention_heads = 3: must divide hidden_size = 128",
    ),
    "heads 0": (_config("num_attention_heads", 0), ModelConfigError, r"num_attention_heads = 0"),
    "heads negative": (_config("num_attention_heads", -4), ModelConfigError, r"num_attention_heads = -4"),
    "heads float": (_config("num_attention_heads", 4.0), ModelConfigError, r"num_attention_heads = 4\.0"),
    "heads bool": (_config("num_attention_heads", True), ModelConfigError, r"num_attention_heads = True"),
    "kv heads not dividing": (
        _config("num_key_value_heads", 3),
        ModelConfigError,
        r"num_key_value_heads = 3: must divide num_attention_heads = 4",
    ),
    "kv heads above heads": (_config("num_key_value_heads", 8), ModelConfigError, r"num_key_value_heads = 8"),
    "head_dim odd": (_config("head_dim", 31), ModelConfigError, r"head_dim = 31: must be even"),
    "vocab huge": (_config("vocab_size", 2**70), ModelConfigError, r"vocab_size = 1180591620717411303424"),
    "hidden 0": (_config("hidden_size", 0), ModelConfigError, r"hidden_size = 0"),
    "intermediate text": (
        _config("intermediate_size", "256"),
        ModelConfigError,
        r"intermediate_size = '256'",
    ),
    "max positions 0": (
        _config("max_position_embeddings", 0),
        ModelConfigError,
        r"max_position_embeddings = 0",
    ),
    "max positions huge": (
        _config("max_position_embeddings", 10**12),
        ModelConfigError,
        r"max_position_embeddings = 1000000000000",
    ),
    "tie flag text": (_config("tie_word_embeddings", "no"), ModelConfigError, r"tie_word_embeddings = 'no'"),
    "layers 0": (_config("num_hidden_layers", 0), ModelConfigError, r"num_hidden_layers = 0"),
    "layers more than listed": (
        _config("num_hidden_layers", 3),
        ModelConfigError,
        r"num_hidden_layers = 3, but the manifest's layers belong to 2 decoder layer\(s\), 0\.\.1",
    ),
    "tp text": (lambda doc: doc.update(tp="1"), ManifestError, r"tp: Input should be a valid integer"),
    "file size float": (
        lambda doc: doc["files"][0].update(size=float(doc["files"][0]["size"])),
        ManifestError,
        r"files\.0\.size: Input should be a valid integer",
    ),
    "act_dtype": (lambda doc: doc.update(act_dtype="float64"), ManifestError, r"act_dtype: Input should be"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_values_are_refused_at_load_naming_the_field(
    case: str, tmp_path: Path, llama_artifact: tuple[PreTrainedModel, Path]
) -> None:
    edit, error, message = CASES[case]
    art = copy_artifact(llama_artifact[1], tmp_path)
    edit_manifest(art, edit)
    (art / "rank0.safetensors").unlink()  # refused before any file is mapped, or this would say so
    with pytest.raises(error, match=message):
        load_model(art)


def test_the_untouched_artifact_loads(llama_artifact: tuple[PreTrainedModel, Path]) -> None:
    assert load_model(llama_artifact[1]).config.rms_norm_eps == 1e-5
