"""The artifact contract: `manifest.json`, written last by the converter (its presence commits the
artifact) and read first by the runtime. Versioned: readers refuse schema versions they don't know.

Artifact layout (a local directory or an S3 key prefix, immutable once committed):

    manifest.json                       this document
    config.json, tokenizer files        copied from the source
    rank{r}.safetensors                 (or rank{r}-{i}-of-{n}.safetensors) tensors of TP rank r

Tensor names inside rank files: linear layers use `{layer}.{suffix}` with the layer's runtime name
(fused: `...self_attn.qkv_proj`, `...mlp.gate_up_proj`) and the kernel's suffixes; every other
tensor (embeddings, norms) keeps its Hugging Face name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kernels.base import LinearSpec
from kernels.errors import KilnError

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
MANIFEST_NAME = "manifest.json"


class ManifestError(KilnError):
    """manifest.json is missing, unreadable, of an unknown schema version, or inconsistent."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceInfo(_Model):
    uri: str
    format: str  # detected checkpoint format: gptq | awq | fp8 | compressed-tensors | dense | <plugin>
    digest: str  # sha256 over the sorted (name, sha256) pairs of `files`
    files: dict[str, str]  # relative file name -> sha256
    quantization: dict[str, Any] | None = None  # detected quantization config, as read


class Rejection(_Model):
    kernel: str
    reason: str


class LayerVerification(_Model):
    ok: bool
    metric: Literal["exact", "max_rel_err", "max_step_err"]  # max_step_err: in units of the int step
    value: float  # 0.0 for exact matches
    bound: float  # the documented bound the value was checked against


class LayerEntry(_Model):
    """One linear layer (fused name) as stored for its kernel. `spec` is per TP rank."""

    kernel: str
    layout_version: int
    spec: dict[str, Any]  # kernels.base.LinearSpec.to_json()
    tensors: list[str]  # tensor suffixes present in every rank file ("qweight", "scales", ...)
    source_tensors: list[str] = Field(default_factory=list)  # checkpoint tensor names read
    rejected: list[Rejection] = Field(default_factory=list)
    fallback: bool = False  # True when a preferred kernel was rejected for this layer's shape
    verification: LayerVerification | None = None

    @field_validator("spec")
    @classmethod
    def _spec_is_a_linear_spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            LinearSpec.from_json(v)
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"spec is not a kernels.base.LinearSpec ({e})") from e
        return v

    def linear_spec(self) -> LinearSpec:
        return LinearSpec.from_json(self.spec)


class FileEntry(_Model):
    name: str  # relative path inside the artifact
    size: int
    sha256: str
    rank: int | None = None  # None: needed by every rank (config, tokenizer)


class Verification(_Model):
    ok: bool
    layers_checked: int
    layers_exact: int
    max_rel_err: float
    seconds: float


class Manifest(_Model):
    schema_version: int = SCHEMA_VERSION
    artifact_id: str
    kiln_version: str
    created_at: str  # ISO 8601 UTC
    source: SourceInfo
    target: str  # kernels.base.Target value
    tp: int
    method: str  # auto | fp8
    options: dict[str, Any] = Field(default_factory=dict)  # e.g. {"fp8_scheme": "tensor"}
    architecture: str  # e.g. LlamaForCausalLM
    act_dtype: str  # activation dtype the kernels were prepared for
    hf_config: dict[str, Any]  # config.json contents
    layers: dict[str, LayerEntry]  # runtime layer name -> entry
    other_tensors: list[str]  # non-linear tensor names (embeddings, norms)
    files: list[FileEntry]
    verification: Verification

    def rank_files(self, rank: int) -> list[FileEntry]:
        return [f for f in self.files if f.rank == rank]

    def shared_files(self) -> list[FileEntry]:
        return [f for f in self.files if f.rank is None]

    def to_json_bytes(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes | str, where: str = MANIFEST_NAME) -> Manifest:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, over-long numbers, deep nesting
            raise ManifestError(
                f"{where}: not valid JSON ({str(e)[:200]}); the artifact is corrupt — pull it again"
            ) from e
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if (
            isinstance(version, bool)
            or not isinstance(version, int)
            or version not in SUPPORTED_SCHEMA_VERSIONS
        ):
            raise ManifestError(
                f"{where}: schema_version {version!r} is not supported by this Kiln "
                f"(supports {sorted(SUPPORTED_SCHEMA_VERSIONS)}); upgrade kiln or re-convert the checkpoint"
            )
        try:
            return cls.model_validate(data)
        except (ValueError, RecursionError) as e:  # pydantic.ValidationError is a ValueError
            raise ManifestError(f"{where}: invalid manifest: {str(e)[:2000]}") from e

    @classmethod
    def load(cls, artifact_dir: Path) -> Manifest:
        path = artifact_dir / MANIFEST_NAME
        if not path.is_file():
            raise ManifestError(f"{path} not found: not a committed Kiln artifact (conversion incomplete?)")
        return cls.parse(path.read_bytes(), str(path))


def source_digest(files: dict[str, str]) -> str:
    """sha256 over the sorted (relative name, file sha256) pairs of a source checkpoint."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def artifact_id(
    source_digest_hex: str,
    target: str,
    tp: int,
    method: str,
    layout_versions: dict[str, int],
    options: dict[str, Any] | None = None,
) -> str:
    """Digest of what determines an artifact's bytes: same inputs -> same id (conversion is a no-op)."""
    key = json.dumps(
        {
            "source": source_digest_hex,
            "target": target,
            "tp": tp,
            "method": method,
            "layouts": dict(sorted(layout_versions.items())),
            "options": dict(sorted((options or {}).items())),
            "schema": SCHEMA_VERSION,
        },
        sort_keys=True,
    )
    return "ka-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
