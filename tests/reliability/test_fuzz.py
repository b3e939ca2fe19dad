"""Property-based fuzzing (bounded; bench/fuzz.py runs >= 10,000 cases per target): over the
safetensors header validator and readers, the config detector, Manifest.parse and the GGUF container
parser, every input either succeeds or raises the target's documented error class —
SafetensorsFormatError, a KilnError (QuantConfigError / ConversionError / UnsupportedError),
ManifestError, GgufFormatError — never anything else (and a GGUF file the parser accepts reads the
same through gguf.GGUFReader).

Manifest values, exhaustively: every numeric field of two real manifests (a dense Llama, a GPTQ int4
conversion) set to every hostile value (NaN, ±inf, negative, zero, huge, wrong types) is refused at
load with a KilnError, or loads and generates a first token with a finite logprob."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from tests.reliability.fuzz_targets import (
    ConfigTarget,
    CrashedAtLoad,
    FailedAtFirstToken,
    GgufTarget,
    ManifestTarget,
    ManifestValuesTarget,
    SafetensorsTarget,
    fuzz_settings,
    gen_gguf,
    gen_safetensors,
    gguf_seed,
    manifest_from_conversion,
    random_json,
)
from tests.reliability.st_files import build

FUZZ = fuzz_settings(200, HealthCheck.data_too_large)
RNG = st.randoms(use_true_random=False)


@pytest.fixture(scope="module")
def config_target(tmp_path_factory: pytest.TempPathFactory) -> ConfigTarget:
    return ConfigTarget(tmp_path_factory.mktemp("fuzz-configs"))


@pytest.fixture(scope="module")
def manifest_target(tmp_path_factory: pytest.TempPathFactory) -> ManifestTarget:
    return ManifestTarget(manifest_from_conversion(tmp_path_factory.mktemp("fuzz-manifest")))


SAFETENSORS = SafetensorsTarget(with_loader=True)


@FUZZ
@given(st.binary(max_size=256))
def test_safetensors_random_bytes(blob: bytes) -> None:
    SAFETENSORS.run(blob)


@FUZZ
@given(RNG)
def test_safetensors_mutated_files(rnd: random.Random) -> None:
    SAFETENSORS.run(gen_safetensors(rnd))


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "__metadata__", "x/y", ""]),
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(["F32", "F16", "U8", "Q4", "BOOL"]),
                "shape": st.lists(st.integers(-2, 5) | st.floats(0, 3) | st.booleans(), max_size=3),
                "data_offsets": st.lists(st.integers(-4, 40), min_size=0, max_size=3),
            }
        )
        | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
        max_size=3,
    ),
    st.integers(0, 48),
)
def test_safetensors_generated_headers(header: dict[str, object], data_len: int) -> None:
    SAFETENSORS.run(build(header, bytes(data_len)))


GGUF = GgufTarget(differential=True)


@FUZZ
@given(RNG)
def test_gguf_mutated_files(rnd: random.Random) -> None:
    GGUF.run(gen_gguf(rnd))


@FUZZ
@given(st.binary(max_size=128), st.integers(0, 128))
def test_gguf_random_bytes(blob: bytes, probe: int) -> None:
    GGUF.run((b"GGUF\x03\x00\x00\x00" + blob, probe))


@FUZZ
@given(RNG)
def test_config_detector(config_target: ConfigTarget, rnd: random.Random) -> None:
    config_target.run(config_target.generate(rnd))


@FUZZ
@given(RNG)
def test_config_detector_random_quantization_config(config_target: ConfigTarget, rnd: random.Random) -> None:
    q = random_json(rnd, depth=1)
    config = dict(config_target.ckpts["dense"].config, quantization_config=q)
    config_target.run(("gptq", config, {}))


@FUZZ
@given(RNG)
def test_manifest_parse(manifest_target: ManifestTarget, rnd: random.Random) -> None:
    manifest_target.run(manifest_target.generate(rnd))


def test_fuzz_targets_accept_their_valid_inputs(
    config_target: ConfigTarget, manifest_target: ManifestTarget, tmp_path: Path
) -> None:
    """The fuzzers start from inputs that pass: a target that rejects everything fuzzes nothing."""
    from runtime.artifact.manifest import Manifest
    from runtime.artifact.safetensors_header import validate_header
    from services.convert.detect import detect_format
    from tests.reliability.st_files import valid_file

    assert len(validate_header("ok", valid_file(), len(valid_file())).tensors) == 2
    assert {detect_format(c).name for c in config_target.ckpts.values()} == {
        "gptq", "awq", "fp8", "compressed-tensors", "dense",
    }  # fmt: skip
    assert Manifest.parse(manifest_target.valid).layers
    seed = gguf_seed()
    assert GGUF.run((seed.blob, 64)) and len(seed.fields) > 50


def test_the_manifest_fuzzer_counts_an_accepted_traversal_name_as_a_failure(
    manifest_target: ManifestTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Manifest.parse's file-name rule switched off, the fuzzer's own check reports the hostile
    names it generates: an accepted `../../x` fails the run even though nothing raised."""
    import runtime.artifact.manifest as manifest_module
    from tests.reliability.fuzz_targets import UnsafeNameAccepted

    monkeypatch.setattr(manifest_module, "check_file_name", lambda name: name)
    rnd = random.Random(7)
    failures = 0
    for _ in range(200):
        try:
            manifest_target.run(manifest_target.generate(rnd))
        except UnsafeNameAccepted:
            failures += 1
    assert failures > 0


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPTQ int4 g64 checkpoint converted for cpu (cpu_int4 layers, a quantized lm_head)."""
    from devtools.builders.synthetic import Dims, write_checkpoint
    from services.convert.library import ConversionRequest, convert

    work = tmp_path_factory.mktemp("fuzz-int4")
    dims = Dims(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1, head_dim=64, vocab=64)
    src = write_checkpoint(work / "src", "gptq", dims=dims, group_size=64)
    return Path(convert(ConversionRequest(str(src), ["cpu"], out=str(work / "out")))[0].uri)


@pytest.mark.parametrize("base", ["llama_artifact", "int4_artifact"])
def test_manifest_values_are_refused_at_load_or_run(
    base: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    artifact = request.getfixturevalue(base)
    target = ManifestValuesTarget(artifact[1] if isinstance(artifact, tuple) else artifact, tmp_path)
    cases = target.cases()
    failures, loaded = [], 0
    for case in cases:
        try:
            if target.run(case):
                loaded += 1
        except (CrashedAtLoad, FailedAtFirstToken) as e:
            failures.append(f"{type(e).__name__}: {e}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:30])
    assert len(target.paths) > 50 and loaded < len(cases) // 4  # real coverage; most are refused
