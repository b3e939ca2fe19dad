"""The conversion's single-pass I/O and cheap verification: the streaming writer's one-write file
(alignment, header reservation and its fallback, sha256), the reader's back-to-back layer buffer
with copy-free fusing, and verification shortcuts that still catch one wrong value."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels import base as kernel_base
from kernels.base import DenseWeight, IntWeight
from kernels.dense import DenseKernel
from services.convert.checkpoint import Checkpoint, open_checkpoint
from services.convert.errors import ConversionError
from services.convert.library import ConversionRequest, VerificationError, convert
from services.convert.pipeline import Progress
from services.convert.safetensors_io import StreamingSafetensorsWriter
from services.convert.tp import cat_rows
from services.convert.verify import DENSE_CAST_REL_BOUND, FP8_REL_BOUND, compare, compare_dense_stored
from services.storage.local import LocalSource, LocalStore


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(6, 8, generator=g).bfloat16(),
        "b.odd": torch.arange(3, dtype=torch.uint8),  # 3 bytes: leaves the 8-byte stride
        "c.scales": torch.randn(5, generator=g),  # 20 bytes
        "d.qweight": torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=g),
        "e.bias": torch.randn(3, generator=g).half(),  # 6 bytes
        "f.scalar": torch.tensor(2.5, dtype=torch.float64),
        "g.empty": torch.empty(0, 4),
        "h.fp8": torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn),
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _read_back(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, list[int]], int]:
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, offsets, 8 + hlen  # noqa: SIM118


@pytest.mark.parametrize("reserve", [1 << 16, 16], ids=["reserved", "header-outgrows-reservation"])
def test_writer_writes_an_aligned_file_with_its_sha256(tmp_path: Path, reserve: int) -> None:
    tensors = _mixed_tensors()
    w = StreamingSafetensorsWriter(
        tmp_path / "rank0.safetensors", reserve_header_bytes=reserve, max_pending_bytes=64
    )
    for name, t in tensors.items():
        w.add(name, t)
    path = w.finish()
    raw = path.read_bytes()
    assert (w.size, w.sha256) == (len(raw), hashlib.sha256(raw).hexdigest())
    got, offsets, base = _read_back(path)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(_bytes(got[name]), _bytes(t))
        start = base + offsets[name][0]
        assert start % t.element_size() == 0, f"{name} starts at {start}, not aligned to {t.element_size()}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.safetensors"]  # no side files left


def test_writer_discard_leaves_nothing(tmp_path: Path) -> None:
    w = StreamingSafetensorsWriter(tmp_path / "rank0.safetensors")
    for name, t in _mixed_tensors().items():
        w.add(name, t)
    w.discard()
    assert list(tmp_path.iterdir()) == []


def test_reader_lays_shards_back_to_back_and_fuses_without_a_copy(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    names = ["m.q_proj", "m.k_proj", "m.v_proj"]
    tensors = {f"{n}.{s}": torch.randn(r, 16 if s == "weight" else 1, generator=g).bfloat16().squeeze(-1)
               for n, r in zip(names, (8, 4, 4), strict=True) for s in ("weight", "bias")}  # fmt: skip
    tensors["other"] = torch.arange(5, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(LocalSource(tmp_path))
    wanted = [f"{n}.{s}" for n in names for s in ("weight", "bias")]  # interleaved, as a plan asks
    got = ckpt.read([*wanted, "other"])
    assert list(got) == [*wanted, "other"]
    for name, t in got.items():
        assert torch.equal(t, tensors[name]), name
    weights = [got[f"{n}.weight"] for n in names]
    fused = cat_rows(weights)
    assert torch.equal(fused, torch.cat(weights))
    assert fused.data_ptr() == weights[0].data_ptr()  # a view: no copy
    biases = cat_rows([got[f"{n}.bias"] for n in names])
    assert torch.equal(biases, torch.cat([tensors[f"{n}.bias"] for n in names]))
    apart = [weights[1], weights[0]]  # not back to back: an ordinary concatenation
    assert (
        torch.equal(cat_rows(apart), torch.cat(apart)) and cat_rows(apart).data_ptr() != weights[1].data_ptr()
    )


def _one_off(t: torch.Tensor, step: float) -> torch.Tensor:
    bad = t.clone()
    bad[3, 5] += step
    return bad


def test_dense_verification_catches_one_wrong_value() -> None:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    src = DenseWeight(w)
    assert compare_dense_stored(w, src).metric == "exact"  # the source tensor itself
    assert compare_dense_stored(w.clone(), src).metric == "exact"
    assert compare_dense_stored(w.float(), src).metric == "exact"  # widened (cpu stores fp32)
    assert compare_dense_stored(w.half(), src).ok  # narrowed cast: within the cast bound
    wrong = compare_dense_stored(_one_off(w, 0.5), src)
    assert not wrong.ok and wrong.value > DENSE_CAST_REL_BOUND
    assert not compare_dense_stored(_one_off(w.float(), 2.0**-6), src).ok
    nan = w.clone()
    nan[0, 0] = float("nan")
    assert not compare_dense_stored(nan.clone(), DenseWeight(nan)).ok  # a NaN never passes a comparison
    assert not compare(_one_off(w.float(), 1.0), src, torch.bfloat16, online="fp8").ok
    assert compare(w.float(), src, torch.bfloat16, online="fp8").value <= FP8_REL_BOUND


@pytest.mark.parametrize("block_elements", [1, 1 << 22], ids=["64-row blocks", "one block"])
def test_integer_verification_in_row_blocks(block_elements: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification compares one row block at a time; the verdicts are those of the whole layer: exact
    (scales as stored or cast to the activation dtype), within the scale-rounding allowance, one wrong
    code in the last block (a whole step), and a stored weight with rows missing."""
    monkeypatch.setattr(kernel_base, "ROW_BLOCK_ELEMENTS", block_elements)
    gen = torch.Generator().manual_seed(9)
    w = IntWeight(
        codes=torch.randint(0, 16, (200, 64), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(2, 200, generator=gen) + 0.5).half(),
        bits=4,
        group_size=32,
    )
    assert len(kernel_base.row_block_slices(200, 64)) == (4 if block_elements == 1 else 1)
    assert compare(w.dequantize(), w, torch.bfloat16).metric == "exact"
    rounded = dataclasses.replace(w, scales=w.scales.bfloat16()).dequantize()
    assert compare(rounded, w, torch.bfloat16).metric == "exact"  # the activation-dtype reference
    within = compare(rounded, w, torch.float32)  # fp16 -> bf16 scales: inside the rounding allowance
    assert within.ok and within.metric == "max_step_err" and within.value == 0.0
    wrong = w.dequantize()
    wrong[199, 40] += float(w.scales[1, 199])
    off = compare(wrong, w, torch.bfloat16)
    assert not off.ok and off.value >= 0.75
    assert not compare(w.dequantize()[:150], w, torch.bfloat16).ok


def test_a_wrong_dense_value_fails_the_conversion(
    ckpt: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DenseKernel.prepare

    def one_wrong_value(
        self: DenseKernel, weight: object, spec: object, target: object
    ) -> dict[str, torch.Tensor]:
        out = real(self, weight, spec, target)  # type: ignore[arg-type]
        if "q_proj" in str(getattr(spec, "name", "")) or "qkv" in str(getattr(spec, "name", "")):
            out["weight"] = out["weight"].clone()
            out["weight"][0, 0] += 1.0
        return out

    monkeypatch.setattr(DenseKernel, "prepare", one_wrong_value)
    with pytest.raises(VerificationError, match=r"qkv_proj.*dense"):
        convert(ConversionRequest(str(ckpt("bf16")), ["sm80"], out=str(tmp_path / "out")))


@pytest.mark.parametrize("hashes_at", ["converting", "writing"])
def test_source_hashes_arrive_while_converting(
    ckpt: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashes_at: str
) -> None:
    """The artifact id follows the source hashes, which finish mid-way (or only at the end): a fresh
    conversion commits under that id, a repeated one stops early as a no-op, and no scratch is left."""
    src, out, work = str(ckpt("bf16")), tmp_path / "out", tmp_path / "work"
    work.mkdir()
    real = Checkpoint._compute_hashes
    gate = threading.Event()

    def slow_hashes(self: Checkpoint) -> dict[str, str]:
        assert gate.wait(60), "the test never released the hashes"
        return real(self)

    def release(p: Progress) -> None:
        if p.stage == hashes_at and (p.stage == "writing" or p.done == 3):
            gate.set()
            time.sleep(0.2)  # let the hashing thread finish before the next poll

    monkeypatch.setattr(Checkpoint, "_compute_hashes", slow_hashes)
    (first,) = convert(ConversionRequest(src, ["cpu"], out=str(out)), progress=release, workdir=work)
    gate.clear()
    seen: list[Progress] = []

    def release_and_record(p: Progress) -> None:
        seen.append(p)
        release(p)

    (again,) = convert(
        ConversionRequest(src, ["cpu"], out=str(out)), progress=release_and_record, workdir=work
    )
    assert not first.reused and again.reused and again.artifact_id == first.artifact_id
    monkeypatch.setattr(Checkpoint, "_compute_hashes", real)
    (plain,) = convert(ConversionRequest(src, ["cpu"], out=str(tmp_path / "plain")))
    assert plain.artifact_id == first.artifact_id and plain.manifest.source == first.manifest.source
    if hashes_at == "converting":  # stopped as soon as the id was known
        assert max(p.done for p in seen if p.stage == "converting") < len(first.manifest.layers)
    assert list(work.iterdir()) == [] and LocalStore(out).staging_entries() == []
    assert LocalStore(out).list_ids() == [first.artifact_id]


def test_reserved_tensors_written_in_slices_interleave_with_others(tmp_path: Path) -> None:
    """Stacked expert tensors arrive expert by expert, interleaved with each other and with whole
    tensors; odd-sized ones land in the tail. The file reads back exactly and validates strictly."""
    from runtime.artifact.safetensors_header import validate_header

    gen = torch.Generator().manual_seed(0)
    stacked = {
        "g.w13.qweight": torch.randint(-(2**31), 2**31 - 1, (3, 8, 16), generator=gen, dtype=torch.int32),
        "g.w13.scales": torch.randn(3, 2, 5, generator=gen).to(torch.bfloat16),  # 60 bytes: tail
        "g.w2.weight": torch.randn(3, 4, 4, generator=gen),
    }
    whole = {"a.weight": torch.randn(6, 6, generator=gen), "b.bias": torch.randn(3, generator=gen)}
    path = tmp_path / "rank0.safetensors"
    w = StreamingSafetensorsWriter(path, reserve_header_bytes=64, max_pending_bytes=32)
    w.add("a.weight", whole["a.weight"])
    for name, t in stacked.items():
        w.reserve(name, t.dtype, tuple(t.shape))
    w.add("b.bias", whole["b.bias"])
    for e in (2, 0, 1):  # any order
        for name, t in stacked.items():
            w.write_slice(name, e, t[e])
    w.finish()
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    validate_header(path.name, raw[: 8 + header_len], len(raw))
    with safe_open(str(path), "pt") as f:
        for name, t in {**stacked, **whole}.items():
            assert torch.equal(f.get_tensor(name), t), name


def test_a_reserved_tensor_left_incomplete_fails_the_file(tmp_path: Path) -> None:
    w = StreamingSafetensorsWriter(tmp_path / "x.safetensors")
    w.reserve("g.w2.weight", torch.float32, (4, 2))
    w.write_slice("g.w2.weight", 1, torch.zeros(2))
    with pytest.raises(ConversionError, match=r"never fully written.*\[0, 2, 3\]"):
        w.finish()
    with pytest.raises(ConversionError, match="written twice"):
        w2 = StreamingSafetensorsWriter(tmp_path / "y.safetensors")
        w2.reserve("t", torch.float32, (2, 2))
        w2.write_slice("t", 0, torch.zeros(2))
        w2.write_slice("t", 0, torch.zeros(2))
