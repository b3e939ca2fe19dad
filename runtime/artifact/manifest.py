"""The artifact contract: `manifest.json`, written last by the converter (its presence commits the
artifact) and read first by the runtime. Versioned: readers refuse schema versions they don't know.

Artifact layout (a local directory or an S3 key prefix, immutable once committed):

    manifest.json                       this document
    config.json, tokenizer files        copied from the source
    rank{r}.safetensors                 tensors of TP rank r (the loader maps whatever rank files the
                                        manifest lists for r)

Tensor names inside rank files: linear layers use `{layer}.{suffix}` with the layer's runtime name
(fused: `...self_attn.qkv_proj`, `...mlp.gate_up_proj`) and the kernel's suffixes; every other
tensor (embeddings, norms) keeps its Hugging Face name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kernels.base import LinearSpec
from kernels.errors import KilnError
from kernels.moe_base import MoESpec
from kernels.targets import Target
from runtime.artifact.spec_values import check_linear_spec, check_moe_spec

SCHEMA_VERSION = 1
# Bump when the converter writes different bytes for the same inputs (2: config.json carries Kiln's
# quantization config, runtime/artifact/hf_config.py), so such artifacts get new ids.
ARTIFACT_REVISION = 2
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2, 3})
MOE_SCHEMA_VERSION = 2  # manifests with expert groups (schema 1 readers could not run them)
DERIVED_SCHEMA_VERSION = 3  # manifests with derived tensors (MLA's absorbed matrices)
MANIFEST_NAME = "manifest.json"
# A manifest is read whole and parsed before anything else: larger ones are refused unread. Real ones
# are KBs to a few MB (a 94-layer, 128-expert MoE lists its ≈150k source tensor names in ≈10 MB).
MAX_MANIFEST_BYTES = 64 << 20
MAX_TP = 1 << 12
# Every file of an artifact lies directly in its directory (or key prefix): one path component of
# letters, digits, '_', '-' and '.', not starting with '.', so never '..', a path, or a hidden file.
FILE_NAME_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}"
ARTIFACT_ID_PATTERN = r"ka-[0-9a-f]{32}"
# Suffixes of the files a pull keeps next to an artifact's files while downloading (`<name>.part`,
# its progress record `<name>.part.progress`, `<name>.part.progress.tmp`, `manifest.json.tmp`): no
# artifact file may carry one, or a pull would overwrite or delete a file the manifest lists.
PART_SUFFIX = ".part"
PROGRESS_SUFFIX = ".part.progress"
TMP_SUFFIX = ".tmp"
RESERVED_SUFFIXES = (PART_SUFFIX, PROGRESS_SUFFIX, TMP_SUFFIX)
_FILE_NAME_RE = re.compile(FILE_NAME_PATTERN)
_ARTIFACT_ID_RE = re.compile(ARTIFACT_ID_PATTERN)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class ManifestError(KilnError):
    """manifest.json is missing, unreadable, of an unknown schema version, or inconsistent."""


class UnsafeArtifactPathError(ManifestError):
    """A file name from a manifest would resolve outside its artifact (traversal or symlink)."""


def check_file_name(name: str) -> str:
    """`name` if it is a plain artifact file name (see FILE_NAME_PATTERN) without a suffix the pull
    cache reserves (RESERVED_SUFFIXES); else ValueError."""
    if not _FILE_NAME_RE.fullmatch(name):
        raise ValueError(
            f"file name {name[:80]!r} is not a plain file name of the artifact (one path component of "
            "letters, digits, '_', '-', '.', not starting with '.'); the manifest was tampered with"
        )
    reserved = next((s for s in RESERVED_SUFFIXES if name.endswith(s)), None)
    if reserved is not None:
        raise ValueError(
            f"file name {name[:80]!r} ends in {reserved!r}, which `kiln pull` reserves for its own "
            f"temporary files ({', '.join(RESERVED_SUFFIXES)}); the manifest was tampered with — "
            "re-convert the artifact"
        )
    return name


def is_artifact_id(value: str) -> bool:
    return bool(_ARTIFACT_ID_RE.fullmatch(value))


def artifact_file(artifact_dir: Path, name: str) -> Path:
    """The path of artifact file `name` inside `artifact_dir`, refusing names that are not plain file
    names and symlinks that lead out of the artifact (a path may not exist yet: pulls create it)."""
    try:
        check_file_name(name)
    except ValueError as e:
        raise UnsafeArtifactPathError(f"{artifact_dir}: {e}") from e
    path = artifact_dir / name
    root = os.path.realpath(artifact_dir)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise UnsafeArtifactPathError(
            f"{path} is a symlink leading out of the artifact directory; refusing to follow it "
            "(delete the artifact from the cache and pull it again)"
        )
    return path


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Numbers are never coerced ("4", 4.5 or true are not a count) and never negative.
Count = Annotated[int, Field(strict=True, ge=0)]
Amount = Annotated[float, Field(strict=True, ge=0)]


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
    value: Amount  # 0.0 for exact matches
    bound: Amount  # the documented bound the value was checked against


class LayerEntry(_Model):
    """One linear layer (fused name) as stored for its kernel. `spec` is per TP rank."""

    kernel: str
    layout_version: Count
    spec: dict[str, Any]  # kernels.base.LinearSpec.to_json()
    tensors: list[str]  # tensor suffixes present in every rank file ("qweight", "scales", ...)
    source_tensors: list[str] = Field(default_factory=list)  # checkpoint tensor names read
    rejected: list[Rejection] = Field(default_factory=list)
    fallback: bool = False  # True when a preferred kernel was rejected for this layer's shape
    verification: LayerVerification | None = None

    @field_validator("spec")
    @classmethod
    def _spec_is_a_linear_spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_linear_spec(v)
        try:
            LinearSpec.from_json(v)
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"spec is not a kernels.base.LinearSpec ({e})") from e
        return v

    def linear_spec(self) -> LinearSpec:
        return LinearSpec.from_json(self.spec)


class ExpertGroupEntry(_Model):
    """One MoE layer's expert group, stacked for its expert-group kernel. `spec` is rank 0's."""

    kernel: str
    layout_version: Count
    spec: dict[str, Any]  # kernels.moe_base.MoESpec.to_json()
    tensors: list[str]  # stacked tensor names relative to the group ("w13.qweight", "w2.scales", ...)
    source_tensors: list[str] = Field(default_factory=list)
    rejected: list[Rejection] = Field(default_factory=list)
    fallback: bool = False
    verification: LayerVerification | None = None  # the worst expert's

    @field_validator("spec")
    @classmethod
    def _spec_is_a_moe_spec(cls, v: dict[str, Any]) -> dict[str, Any]:
        check_moe_spec(v)
        try:
            MoESpec.from_json(v)
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"spec is not a kernels.moe_base.MoESpec ({e})") from e
        return v

    def moe_spec(self) -> MoESpec:
        return MoESpec.from_json(self.spec)


class DerivedEntry(_Model):
    """Tensors the converter derives from the checkpoint so that no load computes them (MLA's
    absorbed W_UK_T / W_UV from kv_b_proj), per rank. `kernel` names the derivation and
    `layout_version` its version (both in the artifact id, like a kernel's)."""

    kernel: str
    layout_version: Count
    tensors: list[str]  # suffixes present in every rank file, relative to the entry's name
    source_tensors: list[str] = Field(default_factory=list)
    verification: LayerVerification | None = None


class FileEntry(_Model):
    name: str  # a plain file name inside the artifact directory (FILE_NAME_PATTERN)
    size: Count
    sha256: str
    rank: Count | None = None  # None: needed by every rank (config, tokenizer)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return check_file_name(v)

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, v: str) -> str:
        if not _SHA256_RE.fullmatch(v):
            raise ValueError(f"sha256 {v[:80]!r} is not 64 lowercase hex digits")
        return v


class Verification(_Model):
    ok: bool
    layers_checked: Count
    layers_exact: Count
    max_rel_err: Amount
    seconds: Amount


class Manifest(_Model):
    schema_version: int = SCHEMA_VERSION
    artifact_id: str
    kiln_version: str
    created_at: str  # ISO 8601 UTC
    source: SourceInfo
    target: Target
    tp: Annotated[int, Field(strict=True, ge=1, le=MAX_TP)]
    method: str  # auto | fp8
    options: dict[str, Any] = Field(default_factory=dict)  # e.g. {"fp8_scheme": "tensor"}
    architecture: str  # e.g. LlamaForCausalLM
    act_dtype: Literal["bfloat16", "float16", "float32"]  # activation dtype the kernels were prepared for
    hf_config: dict[str, Any]  # config.json contents
    layers: dict[str, LayerEntry]  # runtime layer name -> entry
    other_tensors: list[str]  # non-linear tensor names (embeddings, norms)
    # Written only when used (schema 2): expert groups of MoE layers, and whole experts per rank.
    expert_groups: dict[str, ExpertGroupEntry] = Field(default_factory=dict)
    expert_parallel: bool = False
    derived: dict[str, DerivedEntry] = Field(default_factory=dict)  # schema 3, written only when used
    files: list[FileEntry]
    verification: Verification

    @field_validator("artifact_id")
    @classmethod
    def _artifact_id_form(cls, v: str) -> str:
        if not is_artifact_id(v):
            raise ValueError(f"artifact_id {v[:80]!r} is not of the form ka-<32 hex digits>")
        return v

    @model_validator(mode="after")
    def _files_consistent(self) -> Manifest:
        names = [f.name for f in self.files]
        if MANIFEST_NAME in names:
            raise ValueError(f"files lists {MANIFEST_NAME} itself")
        if len(set(names)) != len(names):
            raise ValueError("files lists a file name twice")
        bad = [f.name for f in self.files if f.rank is not None and f.rank >= self.tp]
        if bad:
            raise ValueError(f"file {bad[0]} belongs to rank >= tp={self.tp}")
        if (self.expert_groups or self.expert_parallel) and self.schema_version < MOE_SCHEMA_VERSION:
            raise ValueError(f"expert groups need schema_version {MOE_SCHEMA_VERSION}")
        if self.derived and self.schema_version < DERIVED_SCHEMA_VERSION:
            raise ValueError(f"derived tensors need schema_version {DERIVED_SCHEMA_VERSION}")
        return self

    def rank_files(self, rank: int) -> list[FileEntry]:
        return [f for f in self.files if f.rank == rank]

    def shared_files(self) -> list[FileEntry]:
        return [f for f in self.files if f.rank is None]

    def to_json_bytes(self) -> bytes:
        # Dense artifacts keep the schema-1 document byte for byte: MoE fields only when used.
        unused = {"expert_groups"} if not self.expert_groups else set()
        if not self.expert_parallel:
            unused.add("expert_parallel")
        if not self.derived:
            unused.add("derived")
        return (self.model_dump_json(indent=2, exclude=unused) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes | str, where: str = MANIFEST_NAME) -> Manifest:
        """The manifest in `raw`: at most MAX_MANIFEST_BYTES of JSON without NaN / Infinity, every
        value of its type and range; ManifestError naming the field otherwise."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(_too_large(where, len(raw)))
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, over-long numbers, deep nesting
            raise ManifestError(
                f"{where}: not valid JSON ({str(e)[:200]}); the artifact is corrupt — pull it again"
            ) from e
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        bad = _non_finite_number(data)
        if bad is not None:
            raise ManifestError(
                f"{where}: {bad[0]} = {bad[1]}: numbers must be finite (JSON has no NaN or Infinity); "
                "the manifest was altered — pull the artifact again or re-convert it"
            )
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
        except ValidationError as e:
            raise ManifestError(f"{where}: invalid manifest: {_describe(e)}") from e
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"{where}: invalid manifest: {str(e)[:2000]}") from e

    @classmethod
    def load(cls, artifact_dir: Path) -> Manifest:
        return cls.parse(read_manifest_bytes(artifact_dir), str(artifact_dir / MANIFEST_NAME))


def read_manifest_bytes(artifact_dir: Path) -> bytes:
    """The bytes of `artifact_dir`'s manifest, refused unread when over MAX_MANIFEST_BYTES."""
    path = artifact_dir / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path} not found: not a committed Kiln artifact (conversion incomplete?)")
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(_too_large(str(path), size))
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(_too_large(str(path), len(raw)))
    return raw


def _too_large(where: str, size: int) -> str:
    return (
        f"{where}: {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit of a manifest "
        "(runtime/artifact/manifest.py MAX_MANIFEST_BYTES); it was not parsed — the artifact is corrupt "
        "or was altered"
    )


def _non_finite_number(doc: dict[str, Any]) -> tuple[str, float] | None:
    """(path, value) of the first NaN or infinite number in a parsed JSON document, if any."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "manifest", value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _describe(e: ValidationError, most: int = 5) -> str:
    """Each problem as `field.path: message` (the value included by the message where it helps)."""
    problems = []
    for err in e.errors(include_url=False)[:most]:
        where = ".".join(str(part) for part in err["loc"]) or "manifest"
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] != "value_error":
            message += f" (got {str(err.get('input'))[:80]!r})"
        problems.append(f"{where}: {message}")
    more = e.error_count() - len(problems)
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


def source_digest(files: dict[str, str]) -> str:
    """sha256 over the sorted (relative name, file sha256) pairs of a source checkpoint."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def artifact_id(
    source_digest_hex: str,
    target: Target,
    tp: int,
    method: str,
    layout_versions: dict[str, int],
    options: dict[str, Any] | None = None,
    *,
    revision: int | None = ARTIFACT_REVISION,
) -> str:
    """Digest of what determines an artifact's bytes: same inputs -> same id (conversion is a no-op).
    `revision=None`: the ids of artifacts converted before the revision was part of the digest."""
    fields: dict[str, Any] = {
        "source": source_digest_hex,
        "target": target,
        "tp": tp,
        "method": method,
        "layouts": dict(sorted(layout_versions.items())),
        "options": dict(sorted((options or {}).items())),
        "schema": SCHEMA_VERSION,
    }
    if revision is not None:
        fields["revision"] = revision
    key = json.dumps(fields, sort_keys=True)
    return "ka-" + hashlib.sha256(key.encode()).hexdigest()[:32]


KNOWN_REVISIONS = (ARTIFACT_REVISION, None)


def check_derived_id(manifest: Manifest, where: str = MANIFEST_NAME) -> None:
    """The manifest's artifact id is the digest of its own source, target, tp, method, options and
    kernel layout versions (`artifact_id`): ManifestError when one of them was edited. (The id covers
    only these: the rest of the manifest is pinned by its own sha256, runtime/artifact/pull.py.)"""
    if source_digest(manifest.source.files) != manifest.source.digest:
        raise ManifestError(
            f"{where}: source.digest {manifest.source.digest} is not the digest of source.files; the "
            "manifest was altered — pull the artifact again or re-convert it"
        )
    entries: list[LayerEntry | ExpertGroupEntry | DerivedEntry] = [
        *manifest.layers.values(),
        *manifest.expert_groups.values(),
        *manifest.derived.values(),
    ]
    layouts: dict[str, int] = {}
    for entry in entries:
        if layouts.setdefault(entry.kernel, entry.layout_version) != entry.layout_version:
            raise ManifestError(
                f"{where}: kernel {entry.kernel} is listed with layout versions {layouts[entry.kernel]} and "
                f"{entry.layout_version}; the manifest was altered — pull the artifact again or re-convert it"
            )
    derived = [
        artifact_id(
            manifest.source.digest,
            manifest.target,
            manifest.tp,
            manifest.method,
            layouts,
            manifest.options,
            revision=revision,
        )
        for revision in KNOWN_REVISIONS
    ]
    if manifest.artifact_id not in derived:
        raise ManifestError(
            f"{where}: artifact_id {manifest.artifact_id}, but its source, target, tp, method, options "
            f"and kernel layout versions give {derived[0]}: one of them was altered — pull the artifact "
            "again or re-convert it"
        )


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
