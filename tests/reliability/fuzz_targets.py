"""Fuzz targets shared by tests/reliability/test_fuzz.py (hypothesis, bounded) and bench/fuzz.py (>= 10k).

Each target is (generate(rnd) -> input, run(input)); `run` either succeeds or raises the target's
documented error class (`ALLOWED`); anything else is a crash. Inputs are random bytes / JSON or
mutations of valid files (safetensors, GGUF written by the gguf package), configs from
devtools/builders/synthetic.py and a real manifest.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import random
import shutil
import struct
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, settings

from devtools.builders.synthetic import Dims, write_checkpoint
from kernels.errors import KilnError
from kernels.targets import Target
from runtime.artifact.manifest import Manifest, ManifestError
from runtime.artifact.safetensors_header import DTYPE_SIZES, SafetensorsFormatError, validate_header
from runtime.loader import map_safetensors
from services.convert.checkpoint import Checkpoint, open_checkpoint
from services.convert.detect import detect_format
from services.convert.gguf.container import GgufFile, GgufFormatError, parse_gguf
from services.convert.plan import build_plan
from services.convert.safetensors_io import parse_header, tensor_from_bytes
from services.storage.local import LocalSource
from tests.reliability.st_files import VALID_TENSORS, build, valid_file


def fuzz_settings(max_examples: int, *also_suppress: HealthCheck) -> settings:
    """Bounded, reproducible hypothesis runs for `make test` (bench/fuzz.py runs the long ones)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, *also_suppress],
    )


TINY_DIMS = Dims(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=32, vocab=64)
CONFIG_BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq": ("gptq", {"group_size": 32, "act_order": True}),
    "gptq-v2-asym": ("gptq", {"group_size": 32, "v2": True, "sym": False}),
    "awq": ("awq", {"group_size": 32}),
    "fp8": ("fp8", {}),
    "fp8-block": ("fp8", {"fp8_strategy": "block", "block": (32, 32)}),
    "ct-pack": ("ct-pack", {"group_size": 32}),
    "ct-fp8": ("ct-fp8", {"fp8_strategy": "channel"}),
    "ct-int8": ("ct-int8", {}),
    "dense": ("dense", {}),
}
# Keys the formats read: mutations add them with random values so the detectors' branches are hit.
CONFIG_KEYS = (
    "quant_method", "bits", "w_bit", "group_size", "q_group_size", "desc_act", "sym", "checkpoint_format",
    "format", "is_marlin_format", "lm_head", "dynamic", "modules_in_block_to_quantize", "zero_point",
    "version", "modules_to_not_convert", "activation_scheme", "weight_block_size", "ignored_layers",
    "config_groups", "ignore", "sparsity_config", "transform_config", "targets", "weights",
    "input_activations", "num_bits", "type", "strategy", "symmetric", "actorder", "block_structure",
    "quantization_config", "compression_config", "text_config",
)  # fmt: skip
METHODS = (
    "gptq",
    "awq",
    "fp8",
    "compressed-tensors",
    "compressed_tensors",
    "bitsandbytes",
    "marlin",
    "fbgemm_fp8",
)
STRINGS = ("", "gptq", "gptq_v2", "gemm", "gemv", "group", "channel", "tensor", "block", "int", "float",
           "pack-quantized", "float-quantized", "int-quantized", "naive-quantized", "dense", "re:.*",
           "re:(", "+:.*", "-:.*q_proj", "Linear", "lm_head", "model.layers.0.self_attn.q_proj", "dynamic",
           "static", "\0", "é", "../x")  # fmt: skip


def random_json(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice(
            (0, 1, -1, 2, 3, 4, 8, 16, 32, 64, 128, -5, 2**31, 2**70, rnd.randrange(-1000, 1000))
        )
    if kind == 3:
        return rnd.choice((0.0, 0.5, -1.0, 128.0, float("inf"), float("nan"), 1e308))
    if kind in (4, 5):
        return (
            rnd.choice(STRINGS)
            if rnd.random() < 0.8
            else "".join(chr(rnd.randrange(32, 0x2FF)) for _ in range(5))
        )
    if kind in (6, 7):
        return [random_json(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {rnd.choice(CONFIG_KEYS + STRINGS): random_json(rnd, depth + 1) for _ in range(rnd.randrange(4))}


def _containers(obj: Any, out: list[Any]) -> list[Any]:
    if isinstance(obj, dict | list):
        out.append(obj)
        for v in obj.values() if isinstance(obj, dict) else obj:
            _containers(v, out)
    return out


def mutate_json(obj: Any, rnd: random.Random, keys: tuple[str, ...] = CONFIG_KEYS, rounds: int = 3) -> Any:
    """Random structural edits: replace / delete / add a value, swap types, duplicate containers."""
    obj = copy.deepcopy(obj)
    for _ in range(rnd.randrange(1, rounds + 1)):
        spots = _containers(obj, [])
        if not spots:
            return random_json(rnd)
        c = rnd.choice(spots)
        op = rnd.randrange(4)
        if isinstance(c, dict):
            if op == 0 and c:
                del c[rnd.choice(list(c))]
            elif op == 1 and c:
                c[rnd.choice(list(c))] = random_json(rnd)
            elif op == 2:
                c[rnd.choice(keys)] = random_json(rnd)
            elif c:
                k = rnd.choice(list(c))
                c[k] = [c[k]] if rnd.random() < 0.5 else {"x": c[k]}
        elif c:
            i = rnd.randrange(len(c))
            if op == 0:
                del c[i]
            elif op == 1:
                c[i] = random_json(rnd)
            else:
                c.append(copy.deepcopy(c[i]))
    return obj


# ---- (a) safetensors header validator / readers -------------------------------------------------


def _mutate_bytes(data: bytes, rnd: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randrange(1, 5)):
        op = rnd.randrange(6)
        if op == 0 and b:
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif op == 1:
            del b[rnd.randrange(len(b) + 1) :]
        elif op == 2:
            i = rnd.randrange(len(b) + 1)
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 8)))
        elif op == 3 and len(b) > 1:
            i = rnd.randrange(len(b))
            del b[i : i + rnd.randrange(1, 8)]
        elif op == 4 and len(b) >= 8:
            b[:8] = struct.pack(
                "<Q", rnd.choice((0, 1, 2, len(b), len(b) - 8, 2**63, (100 << 20) + 1, rnd.randrange(300)))
            )
        else:
            i = rnd.randrange(len(b) + 1)
            b[i:i] = rnd.choice((b'"', b"{", b"}", b"[", b",", b":", b"\\", b"\xff", b"\0", b"1e999", b"-"))
    return bytes(b)


def _structured_file(rnd: random.Random) -> bytes:
    """A header built from parts that are each almost right (JSON-level mutation of a valid one)."""
    header, data = json.loads(valid_file()[8 : 8 + struct.unpack("<Q", valid_file()[:8])[0]]), b""
    for blob in (v[2] for v in VALID_TENSORS.values()):
        data += blob
    keys = ("dtype", "shape", "data_offsets", "__metadata__", *DTYPE_SIZES, "U16", "F4", "model.a/b", "x\0y")
    header = mutate_json(header, rnd, keys=keys)
    data = (
        data[: rnd.randrange(len(data) + 1)]
        if rnd.random() < 0.3
        else data + b"\0" * rnd.choice((0, 0, 4, 8))
    )
    raw = json.dumps(header).encode() if rnd.random() < 0.9 else json.dumps(header).encode()[:-1]
    return build(raw, data)


def gen_safetensors(rnd: random.Random) -> bytes:
    r = rnd.random()
    if r < 0.15:
        return bytes(rnd.randrange(256) for _ in range(rnd.randrange(64)))
    if r < 0.55:
        return _mutate_bytes(valid_file(), rnd)
    return _structured_file(rnd)


@dataclass
class SafetensorsTarget:
    """validate_header, the converter's parse_header and tensor reads, and (optionally) the mmap loader."""

    with_loader: bool = True
    _dir: tempfile.TemporaryDirectory[str] | None = None

    def run(self, blob: bytes) -> bool:
        """True when the file was accepted (and then read without error)."""
        accepted = False
        try:
            parsed = validate_header("fuzz.safetensors", blob, len(blob))
            infos = parse_header("fuzz.safetensors", blob[:64], lambda s, e: blob[s:e], len(blob))
            assert set(infos) == set(parsed.tensors)
            for info in infos.values():
                assert 0 <= info.start <= info.end <= len(blob)
                tensor_from_bytes(info, blob[info.start : info.end])
            accepted = True
        except SafetensorsFormatError:
            pass
        if self.with_loader:
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="kiln-fuzz-")
            path = Path(self._dir.name) / "rank0.safetensors"
            path.write_bytes(blob)
            try:
                mapped = map_safetensors(path)
                for t in mapped.tensors.values():
                    t.reshape(-1)[-1:].clone()  # touch the last element: it must lie inside the mapping
                assert accepted, "the loader accepted a file the validator refused"
            except SafetensorsFormatError:
                assert not accepted, "the loader refused a file the validator accepted"
        return accepted


# ---- (b) config detection ------------------------------------------------------------------------


class ConfigTarget:
    """detect_format (+ build_plan for the cpu target) over mutated configs of real synthetic checkpoints."""

    def __init__(self, root: Path) -> None:
        self.ckpts: dict[str, Checkpoint] = {}
        for name, (fmt, opts) in CONFIG_BASES.items():
            path = root / name
            if not (path / "config.json").exists():
                write_checkpoint(path, fmt, dims=TINY_DIMS, **opts)
            self.ckpts[name] = open_checkpoint(LocalSource(path))

    def generate(self, rnd: random.Random) -> tuple[str, dict[str, Any], dict[str, dict[str, Any]]]:
        name = rnd.choice(sorted(self.ckpts))
        base = self.ckpts[name]
        config = copy.deepcopy(base.config)
        side: dict[str, dict[str, Any]] = {}
        r = rnd.random()
        if r < 0.6 and "quantization_config" in config:
            config["quantization_config"] = mutate_json(config["quantization_config"], rnd)
        elif r < 0.8:
            q = random_json(rnd, depth=1)
            if isinstance(q, dict) and rnd.random() < 0.7:
                q["quant_method"] = rnd.choice(METHODS)
            key = rnd.choice(("quantization_config", "compression_config", "text_config"))
            config[key] = {"quantization_config": q} if key == "text_config" else q
        elif r < 0.9:
            q = config.pop("quantization_config", None) or {"bits": 4, "group_size": 32}
            side[rnd.choice(("quantize_config.json", "quant_config.json"))] = mutate_json(q, rnd)
        else:
            config = mutate_json(config, rnd)
            if not isinstance(config, dict):
                config = {"quantization_config": config}
        return name, config, side

    def run(self, case: tuple[str, dict[str, Any], dict[str, dict[str, Any]]]) -> bool:
        """True when a format was detected and planned."""
        name, config, side = case
        ckpt = replace(self.ckpts[name], config=config, side_configs=side, _hashes=None, _hash_future=None)
        try:
            fmt = detect_format(ckpt)
            build_plan(ckpt, fmt, Target.CPU, tp=1, method="auto", fp8_scheme="tensor", disabled_kernels=())
            return True
        except KilnError:
            return False


# ---- (c) Manifest.parse ------------------------------------------------------------------------


MANIFEST_KEYS = (
    "schema_version", "artifact_id", "source", "files", "layers", "verification", "spec", "kernel",
    "tensors", "rank", "size", "sha256", "tp", "hf_config", "ok", "metric", "value", "bound",
)  # fmt: skip


# File names that lead outside an artifact directory (or are not plain names): Manifest.parse must
# refuse every one; an accepted one counts as a failure of the fuzz run, like a crash.
HOSTILE_NAME_PARTS = (
    "..",
    ".",
    "",
    "/",
    "\\",
    "\0",
    "etc",
    "passwd",
    "rank0.safetensors",
    "~",
    "%2e%2e",
    " ",
)


def hostile_file_name(rnd: random.Random) -> str:
    if rnd.random() < 0.3:
        return rnd.choice(("../../escaped.txt", "/etc/passwd", "..", ".", "a/b", "a\\b", "x\0y", ".hidden"))
    parts = [rnd.choice(HOSTILE_NAME_PARTS) for _ in range(rnd.randrange(1, 5))]
    return rnd.choice(("/", "", "./", "../")) + rnd.choice(("/", "\\", "")).join(parts)


def is_plain_file_name(name: str) -> bool:
    """An independent statement of the rule (not the validator's regex): one path component that is
    not '.', '..', hidden, empty or carrying separators / NUL."""
    return (
        bool(name)
        and name not in (".", "..")
        and not name.startswith(".")
        and not any(c in name for c in "/\\\0")
    )


class UnsafeNameAccepted(AssertionError):
    """Manifest.parse accepted a file name that is not a plain name inside the artifact."""


class ManifestTarget:
    def __init__(self, manifest_bytes: bytes) -> None:
        self.valid = manifest_bytes
        self.doc = json.loads(manifest_bytes)
        Manifest.parse(manifest_bytes)

    def generate(self, rnd: random.Random) -> bytes:
        r = rnd.random()
        if r < 0.2:
            doc = copy.deepcopy(self.doc)
            rnd.choice(doc["files"])["name"] = hostile_file_name(rnd)
            return json.dumps(doc).encode()
        if r < 0.6:
            return json.dumps(mutate_json(self.doc, rnd, keys=MANIFEST_KEYS, rounds=4)).encode()
        if r < 0.9:
            return _mutate_bytes(self.valid, rnd)
        return json.dumps(random_json(rnd)).encode()

    def run(self, raw: bytes) -> bool:
        """True when the manifest parsed."""
        try:
            m = Manifest.parse(raw)
        except ManifestError:
            return False
        m.to_json_bytes()
        for entry in m.layers.values():
            entry.linear_spec()  # Manifest.parse has checked every spec
        unsafe = [f.name for f in m.files if not is_plain_file_name(f.name)]
        if unsafe:
            raise UnsafeNameAccepted(f"Manifest.parse accepted file name {unsafe[0]!r}")
        return True


def manifest_from_conversion(work: Path) -> bytes:
    """A real manifest: convert a tiny dense checkpoint for the cpu target."""
    from services.convert.library import ConversionRequest, convert

    src = work / "manifest-src"
    if not (src / "config.json").exists():
        write_checkpoint(src, "gptq", dims=TINY_DIMS, group_size=32, act_order=True)
    result = convert(ConversionRequest(str(src), ["cpu"], out=str(work / "manifest-out")))[0]
    return Path(result.uri, "manifest.json").read_bytes()


# ---- (d) manifest values, loaded -----------------------------------------------------------------

# What an edited manifest can put in a numeric field: NaN / ±inf (Python's json writes NaN and
# Infinity), negative, zero, one, fractional, tiny, huge, and the wrong type.
HOSTILE_VALUES: tuple[Any, ...] = (
    float("nan"), float("inf"), float("-inf"), -1, 0, 1, 0.5, 1e-300, 1e308, 2**63, 10**7, -(2**31),
    "1", True, None, [], {},
)  # fmt: skip
JsonPath = tuple[str | int, ...]


def numeric_paths(doc: Any, path: JsonPath = ()) -> list[JsonPath]:
    """Every place in a JSON document that holds a number (not a bool)."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in numeric_paths(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in numeric_paths(v, (*path, i))]
    return [path] if isinstance(doc, int | float) and not isinstance(doc, bool) else []


def with_value(doc: dict[str, Any], path: JsonPath, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    spot: Any = out
    for key in path[:-1]:
        spot = spot[key]
    spot[path[-1]] = value
    return out


class FailedAtFirstToken(AssertionError):
    """A manifest the loader accepted could not produce a first token with a finite logprob."""


class CrashedAtLoad(AssertionError):
    """The loader raised something other than a KilnError (a traceback for the user)."""


@dataclass(frozen=True)
class ValueCase:
    path: JsonPath
    value: Any

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.path))} = {self.value!r}"


class ManifestValuesTarget:
    """A real artifact whose manifest has one numeric field replaced by a hostile value. The loader
    must refuse it with a KilnError, or load it and generate a first token with a finite logprob:
    anything else at load (CrashedAtLoad) or at the first token (FailedAtFirstToken) is a failure."""

    def __init__(self, artifact: Path, work: Path) -> None:
        self.dir = work / artifact.name
        if not self.dir.exists():
            shutil.copytree(artifact, self.dir)
        self.valid = (artifact / "manifest.json").read_bytes()
        self.doc = json.loads(self.valid)
        self.paths = numeric_paths(self.doc)
        # Synthetic checkpoints carry no tokenizer: such artifacts are loaded without one.
        self.with_tokenizer = any(f["name"] == "tokenizer.json" for f in self.doc["files"])
        if not self.run(ValueCase(("schema_version",), self.doc["schema_version"])):
            raise AssertionError(f"{artifact}: the untouched manifest does not load: nothing to fuzz")

    def cases(self, values_per_field: int | None = None) -> list[ValueCase]:
        """Every numeric field with `values_per_field` hostile values (all of them when None), the
        values rotating over the fields so that every value meets many fields."""
        n = len(HOSTILE_VALUES) if values_per_field is None else values_per_field
        return [
            ValueCase(path, HOSTILE_VALUES[(i * n + j) % len(HOSTILE_VALUES)])
            for i, path in enumerate(self.paths)
            for j in range(n)
        ]

    def run(self, case: ValueCase) -> bool:
        """True when the artifact loaded (and produced its first token), False when refused."""
        from runtime.engine import Engine
        from runtime.loader import load_model
        from runtime.sampling import SamplingParams

        (self.dir / "manifest.json").write_text(json.dumps(with_value(self.doc, case.path, case.value)))
        try:
            loaded = load_model(self.dir, with_tokenizer=self.with_tokenizer)
        except KilnError:
            return False
        except Exception as e:  # anything else reaches the user as a traceback: the failure sought
            raise CrashedAtLoad(f"{case}: {type(e).__name__}: {e}") from e
        outputs = []
        try:
            engine = Engine(loaded, max_num_seqs=1)
            engine.add_request("fuzz", [1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1))
            while engine.has_unfinished() and len(outputs) < 4:
                outputs += engine.step()
        except Exception as e:  # a KilnError here too: the manifest should have been refused at load
            raise FailedAtFirstToken(f"{case}: loaded, then {type(e).__name__}: {e}") from e
        tokens = [
            (t, lp.logprob)
            for out in outputs
            for t, lp in zip(out.new_token_ids, out.logprobs or [], strict=False)
        ]
        vocab = loaded.config.vocab_size
        if not tokens or not all(0 <= t < vocab and math.isfinite(lp) for t, lp in tokens):
            raise FailedAtFirstToken(f"{case}: loaded, then produced (token, logprob) {tokens}")
        return True


# ---- (e) GGUF container ----------------------------------------------------------------------------

# key -> (value, value type, array element type): every GGUF value type, and arrays of six of them.
SAMPLE_GGUF_METADATA: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
    "sample.u8": (200, GGUFValueType.UINT8, None),
    "sample.i8": (-100, GGUFValueType.INT8, None),
    "sample.u16": (60_000, GGUFValueType.UINT16, None),
    "sample.i16": (-30_000, GGUFValueType.INT16, None),
    "sample.u32": (4_000_000_000, GGUFValueType.UINT32, None),
    "sample.i32": (-2_000_000_000, GGUFValueType.INT32, None),
    "sample.f32": (0.1, GGUFValueType.FLOAT32, None),
    "sample.bool": (True, GGUFValueType.BOOL, None),
    "sample.string": ("héllo ✓ <0x0A>", GGUFValueType.STRING, None),
    "sample.u64": (2**64 - 1, GGUFValueType.UINT64, None),
    "sample.i64": (-(2**62), GGUFValueType.INT64, None),
    "sample.f64": (1e-300, GGUFValueType.FLOAT64, None),
    "sample.strings": (["<s>", "", "ünï", "Ġthe"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    "sample.i32s": ([1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    "sample.u64s": ([0, 2**64 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    "sample.u8s": ([0, 255, 7], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    "sample.f32s": ([0.25, -1.5], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    "sample.bools": ([True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
}


def sample_gguf_tensors() -> dict[str, tuple[np.ndarray[Any, Any], GGMLQuantizationType | None]]:
    """name -> (array, raw ggml type): plain F32 / F16 / I32 arrays, and quantized ones as raw
    bytes (GGUFWriter derives the shape from the byte rows: 68 Q8_0 bytes are 64 values)."""
    rng = np.random.default_rng(0)
    return {
        "token_embd.weight": (rng.integers(0, 256, (4, 68), dtype=np.uint8), GGMLQuantizationType.Q8_0),
        "blk.0.attn_q.weight": (rng.integers(0, 256, (2, 144), dtype=np.uint8), GGMLQuantizationType.Q4_K),
        "output_norm.weight": (rng.standard_normal(64).astype(np.float32), None),
        "blk.0.ffn_up.weight": (rng.standard_normal((3, 8)).astype(np.float16), None),
        "blk.0.conv.weight": (rng.standard_normal((2, 3, 4)).astype(np.float32), None),
        "rope_ids": (np.arange(5, dtype=np.int32), None),
    }


def write_sample_gguf(path: Path, *, alignment: int | None = None) -> Path:
    """A small GGUF written by the gguf package's own GGUFWriter (SAMPLE_GGUF_METADATA and
    sample_gguf_tensors), with `general.alignment` when `alignment` is given."""
    writer = GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, vtype, sub_type) in SAMPLE_GGUF_METADATA.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, (array, raw_dtype) in sample_gguf_tensors().items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_reader_view(path: Path) -> dict[str, Any]:
    """What gguf.GGUFReader, the reference reader, makes of a file, in `gguf_view`'s terms."""
    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [
        (t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    return {
        "metadata": {k: f.contents() for k, f in fields.items()},
        "types": {k: tuple(int(t) for t in f.types) for k, f in fields.items()},
        "tensors": tensors,
        "alignment": int(reader.alignment),
        "data_start": int(reader.data_offset),
    }


def gguf_view(parsed: GgufFile) -> dict[str, Any]:
    """parse_gguf's result as gguf_reader_view shows a file (an empty array's type: just ARRAY)."""
    tensors = [(t.name, t.ggml_type, t.shape, t.start, t.nbytes) for t in parsed.tensors.values()]
    return {
        "metadata": parsed.metadata,
        "types": {k: t[:1] if parsed.metadata[k] == [] else t for k, t in parsed.value_types.items()},
        "tensors": tensors,
        "alignment": parsed.alignment,
        "data_start": parsed.data_start,
    }


@dataclass(frozen=True)
class GgufSeed:
    blob: bytes
    data_start: int
    fields: tuple[tuple[int, int], ...]  # (offset, width 4 or 8) of every u32 / u64 field of the header


@functools.cache
def gguf_seed() -> GgufSeed:
    """The sample GGUF and where its integer fields lie (counts, lengths, type ids, dims, offsets),
    located by GGUFReader, independently of the parser under test."""
    with tempfile.TemporaryDirectory(prefix="kiln-gguf-seed-") as tmp:
        path = write_sample_gguf(Path(tmp) / "seed.gguf")
        reader = GGUFReader(path)
        base = reader.data.ctypes.data
        parts = [p for f in reader.fields.values() for p in f.parts]
        parts += [p for t in reader.tensors for p in t.field.parts]
        fields = {
            (p.ctypes.data - base + i * p.dtype.itemsize, p.dtype.itemsize)
            for p in parts
            if p.dtype in (np.uint32, np.uint64)
            for i in range(p.size)
        }
        seed = GgufSeed(path.read_bytes(), int(reader.data_offset), tuple(sorted(fields)))
        del reader, parts
    return seed


def _hostile_int(value: int, width: int, size: int, rnd: random.Random) -> int:
    if width == 4:
        choices = (0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 31, 33, 39, 42, 64, 2**31, 2**32 - 1, value + 1, value ^ 1)
        value = rnd.choice(choices) if rnd.random() < 0.7 else rnd.randrange(48)
    else:
        choices = (0, 1, 2, 7, 2**10 + 1, 2**24 + 1, 2**32, 2**63, 2**64 - 1, size, size - 1, value + 1,
                   value - 1, value * 2, value + 32, (16 << 20) + 1)  # fmt: skip
        value = rnd.choice(choices) if rnd.random() < 0.9 else rnd.getrandbits(64)
    return value % (1 << (8 * width))


def _mutate_gguf(seed: GgufSeed, rnd: random.Random) -> bytes:
    """Bit flips (mostly in the header), truncations, byte insertions / deletions, and integer fields
    (lengths, counts, type ids, dims, offsets) set to hostile values."""
    b = bytearray(seed.blob)
    for _ in range(rnd.randrange(1, 4)):
        op = rnd.randrange(6)
        if op in (0, 1):
            offset, width = rnd.choice(seed.fields)
            if offset + width <= len(b):
                old = int.from_bytes(b[offset : offset + width], "little")
                b[offset : offset + width] = _hostile_int(old, width, len(b), rnd).to_bytes(width, "little")
        elif op == 2 and b:
            i = rnd.randrange(min(len(b), seed.data_start)) if rnd.random() < 0.8 else rnd.randrange(len(b))
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 3:
            del b[rnd.randrange(len(b) + 1) :]
        elif op == 4:
            i = rnd.randrange(len(b) + 1)
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 9)))
        elif b:
            i = rnd.randrange(len(b))
            del b[i : i + rnd.randrange(1, 9)]
    return bytes(b)


def gen_gguf(rnd: random.Random) -> tuple[bytes, int]:
    """(file bytes, probe length): random bytes now and then, mostly a mutated sample GGUF."""
    if rnd.random() < 0.08:
        head = rnd.choice((b"", b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGUF\x00\x00\x00\x03"))
        blob = head + bytes(rnd.randrange(256) for _ in range(rnd.randrange(64)))
    else:
        blob = _mutate_gguf(gguf_seed(), rnd)
    return blob, rnd.choice((0, 8, 24, 100, 512, len(blob)))


class GgufMismatch(AssertionError):
    """parse_gguf accepted a file that gguf.GGUFReader reads differently (or not at all)."""


@dataclass
class GgufTarget:
    """parse_gguf: a GgufFile or GgufFormatError, nothing else. It asks only for byte ranges inside
    the file; an accepted file's tensors lie inside it after the header, without overlap, and (with
    `differential`) GGUFReader reads the same metadata and tensors from it."""

    differential: bool = True
    _dir: tempfile.TemporaryDirectory[str] | None = None

    def run(self, case: tuple[bytes, int]) -> bool:
        blob, probe = case

        def more(start: int, end: int) -> bytes:
            assert min(probe, len(blob)) <= start < end <= len(blob), f"read of {start}-{end}"
            return blob[start:end]

        try:
            parsed = parse_gguf("fuzz.gguf", blob[:probe], more, len(blob))
        except GgufFormatError:
            return False
        ordered = sorted(parsed.tensors.values(), key=lambda t: t.start)
        assert all(parsed.data_start <= t.start < t.end <= len(blob) for t in ordered)
        assert all(a.end <= b.start for a, b in itertools.pairwise(ordered))
        if self.differential:
            self._compare(blob, parsed)
        return True

    def _compare(self, blob: bytes, parsed: GgufFile) -> None:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kiln-fuzz-gguf-")
        path = Path(self._dir.name) / "fuzz.gguf"
        path.write_bytes(blob)
        try:
            reference = gguf_reader_view(path)
        except Exception as e:  # the reference reader refusing a file parse_gguf accepted
            raise GgufMismatch(f"accepted, but GGUFReader raised {type(e).__name__}: {e}") from e
        ours = gguf_view(parsed)
        if repr(ours) != repr(reference):  # repr: NaN metadata values compare equal
            diff = [k for k in ours if repr(ours[k]) != repr(reference[k])]
            raise GgufMismatch(f"parse_gguf and GGUFReader differ in {diff}")
