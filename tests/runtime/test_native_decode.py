"""The native decode step (runtime/native_decode.py) against the eager forward it replaces.

Layers: every layout the step reads (cpu_int4 in each torch pack format, with integer zero points or
float minimums, cpu_int8, dense fp32 / bf16) through the library against the kernel's dequantized
fp32 weight, cpu_w4a8 against its twin and cpu_w8a8 bit for bit, on every instruction-set body this
CPU runs. Models: logits of native and eager decode
steps, batched at different positions and slots, with the bf16 and FP8 KV caches. Serving: an
engine decoding natively and one decoding eagerly, given the same schedule of requests joining and
leaving a running batch, an abort and contexts growing long, answer the same tokens with the same
logprobs.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from devtools.builders.gguf_files import VOCAB_SIZE, write_llama_gguf
from devtools.builders.synthetic import write_checkpoint
from devtools.builders.tiny_artifacts import tiny_hf_model, write_artifact
from kernels.base import DenseWeight, LinearSpec, Target
from kernels.codecs.int8 import quantize_per_token_int8
from kernels.cpu_int4 import PACK_FORMATS, CpuInt4Kernel, pack_int4, stored_pack_format, unpack_int4
from kernels.cpu_int8 import CpuInt8Kernel
from kernels.cpu_w4a8 import CpuW4A8Kernel
from kernels.cpu_w8a8 import CpuW8A8Kernel
from kernels.dense import DenseKernel
from runtime import native_decode
from runtime.engine import Engine
from runtime.kv_cache import KVCache
from runtime.layers import KernelLinear
from runtime.loader import LoadedModel, load_model
from runtime.native_decode import ISA_NAMES, LIBRARY, NativeDecoder, describe_linear, native_decoder
from runtime.sampling import SamplingParams
from services.convert.library import ConversionRequest, convert
from tests.helpers.native import each_body
from tests.helpers.numerics import rel_err
from tests.kernels.test_cpu_kernels import int_spec, int_weight

# The library and the fp32 reference both accumulate in fp32, in different orders.
NATIVE_GEMM_REL_ERR = 2e-6
# Native vs eager logits of a model: the same rounding points (bf16 activations at every linear
# layer, fp32 residual), different summation orders, which a bf16 rounding can turn into one bf16
# ulp (2^-8 relative) of a layer's output; exact fp32 zero offsets (native) vs offsets rounded into
# the op's bf16 zero column (eager); and the LM head exact in fp32 (native) where eager rounds all
# but its top logits to bf16.
FP32_MODEL_LOGITS_ATOL = 1e-4  # fp32 activations (the tiny dense artifacts)
# ... with the FP8 KV cache: a key an ulp apart may round to the neighbouring e4m3 value (1/16 apart)
FP32_FP8_MODEL_LOGITS_ATOL = 2e-3
# bf16 activations, logits of magnitude ~5 (max, mean); also an fp32 model's int4 / int8 layers, whose
# torch ops take and return bf16 (measured 2026-12-07, AVX2 EPYC, max over bodies and KV dtypes:
# bf16 0.121 / 0.033, fp32 0.095 / 0.019; before the step rounded where those ops do, fp32 reached
# 0.70 / 0.082 with the FP8 KV cache)
BF16_MODEL_LOGITS = (0.15, 0.04)
# FP8 KV cache bytes of the two steps that differ (a value an ulp apart rounding to the neighbouring
# e4m3 value, then carried into later layers): a fraction of the whole cache, prefill included.
FP8_CACHE_MISMATCH = 0.01
# int8 activations (cpu_w8a8 per token): the steps' summation orders differ by ulps, which now and
# then move an activation across a rounding boundary: one step, 1/127.5 of its token's largest
# (measured 0.027 / 0.004).
INT8_ACT_MODEL_LOGITS = (0.1, 0.02)
# cpu_w4a8 (int8 activations) with the FP8 KV cache: the small differences above move an activation
# across an int8 rounding boundary now and then, a step of 1/127 of its group's largest value
# (measured 0.244 / 0.056 in bf16, 0.023 / 0.004 in fp32).
W4A8_FP8_MODEL_LOGITS = (0.4, 0.08)
W4A8_FP8_CACHE_MISMATCH = 0.02
# Served tokens: greedy choices equal, and their logprobs within this.
LOGPROB_ATOL = 0.05
GGUF_TYPES = {"self_attn": Q.Q4_0, "mlp.down_proj": Q.Q4_0, "mlp": Q.Q4_1}


def _lib() -> ctypes.CDLL:
    lib = LIBRARY.get()
    if lib is None:
        pytest.skip("no C compiler: the native decode step is not built here (eager decodes)")
    return lib


@pytest.fixture(params=["float32", "bfloat16"])
def act(request: pytest.FixtureRequest) -> str:
    """The model's activation dtype, forced either way: this CPU's own choice and the other kind's
    (bf16 is emulated where the CPU has no native bf16: slower, the same numbers)."""
    return str(request.param)


@pytest.fixture(params=ISA_NAMES)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction-set body this CPU can run (skipped above what it has)."""
    yield from each_body(_lib().kiln_set_isa, ISA_NAMES, request.param)


def _bound(kernel: object, tensors: dict[str, torch.Tensor], spec: LinearSpec) -> KernelLinear:
    layer = KernelLinear(spec.name)
    layer.bind(kernel, spec, tensors)  # type: ignore[arg-type]
    return layer


def _native_apply(layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    described = describe_linear(layer, round_io=False, op_rounding=False)
    y = torch.empty(x.shape[0], described.struct.n)
    assert (
        _lib().kiln_linear_apply(ctypes.pointer(described.struct), x.shape[0], x.data_ptr(), y.data_ptr())
        == 0
    )
    return y


INT8_ACT_QMAX = 32767.0  # decode_step.c's I8_QMAX: an INT8 layer's input, per token to int16


def _int16_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the step multiplies an INT8 layer's input: rint(x · QMAX / amax) · (amax / QMAX) per token."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, INT8_ACT_QMAX) / amax  # a true fp32 division (scalar / tensor is not)
    q = torch.round(x * inv)  # half to even, as lrintf
    return torch.where(amax > 0, q * (amax / INT8_ACT_QMAX), torch.zeros_like(x))


def _reference(
    kernel: object, tensors: dict[str, torch.Tensor], spec: LinearSpec, x: torch.Tensor
) -> torch.Tensor:
    y = x @ kernel.dequantize(tensors, spec).T  # type: ignore[attr-defined]
    return y + tensors["bias"].float() if "bias" in tensors else y


def _repacked(
    tensors: dict[str, torch.Tensor], spec: LinearSpec, fmt: tuple[int, bool]
) -> dict[str, torch.Tensor]:
    codes = unpack_int4(tensors["qweight"], spec.n, spec.k, *stored_pack_format(tensors))
    out = dict(tensors)
    out["qweight"] = pack_int4(codes, *fmt)
    out["pack_format"] = torch.tensor([fmt[0], int(fmt[1])], dtype=torch.int32)
    return out


@pytest.mark.parametrize("fmt", PACK_FORMATS, ids=lambda f: f"{f[0]}{'split' if f[1] else 'pairs'}")
@pytest.mark.parametrize("zero", ["symmetric", "zero_points", "float_mins"])
def test_int4_rows_match_the_dequantized_weight(isa: str, fmt: tuple[int, bool], zero: str) -> None:
    """N = 208 = 3 blocks of 64 and a 16-row tail (adjacent pairs), K = 192 in op groups of 64."""
    w = int_weight(208, 192, group_size=64, symmetric=zero != "zero_points", seed=3)
    if zero == "float_mins":
        w = replace(w, mins=torch.randn(w.scales.shape, generator=torch.Generator().manual_seed(4)) * 0.01)
    spec = replace(int_spec(w), float_zeros=zero == "float_mins")
    kernel = CpuInt4Kernel()
    tensors = _repacked(kernel.prepare(w, spec, Target.CPU), spec, fmt)
    layer = KernelLinear(spec.name)
    layer.kernel, layer.spec, layer.tensors = kernel, spec, tensors  # as stored: no repack at bind
    for m in (1, 2, 3, 5, 16):
        x = torch.randn(m, spec.k).to(torch.bfloat16).float()
        got, want = _native_apply(layer, x), _reference(kernel, tensors, spec, x)
        assert rel_err(got, want) < NATIVE_GEMM_REL_ERR, (m, rel_err(got, want))


@pytest.mark.parametrize("zero", ["symmetric", "zero_points", "float_mins"])
@pytest.mark.parametrize("group", [32, -1])
def test_w4a8_rows_match_the_kernels_twin(isa: str, zero: str, group: int) -> None:
    """cpu_w4a8 through the step's pool (its bodies from the kernel's header, under the step's ISA
    cap) against the kernel's torch twin, which quantizes the activations bit for bit alike."""
    w = int_weight(208, 192, group_size=group, symmetric=zero != "zero_points", seed=3)
    if zero == "float_mins":
        w = replace(w, mins=torch.randn(w.scales.shape, generator=torch.Generator().manual_seed(4)) * 0.01)
    spec = replace(int_spec(w), float_zeros=zero == "float_mins", int8_activations=True)
    kernel = CpuW4A8Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    layer = _bound(kernel, tensors, spec)
    for m in (1, 2, 3, 5, 9, 16):
        x = torch.randn(m, spec.k).to(torch.bfloat16).float()
        got, want = _native_apply(layer, x), kernel.reference(x, tensors, spec)
        assert rel_err(got, want) < NATIVE_GEMM_REL_ERR, (m, rel_err(got, want))


@pytest.mark.parametrize("n,k", [(576, 1536), (100, 40), (52, 200)])
def test_w8a8_rows_are_the_kernels_bit_for_bit(isa: str, n: int, k: int) -> None:
    """cpu_w8a8 (--int8-activations' int8 head): the same per-token quantization and exact integer
    sums as the kernel's torch path, then sum * scale_t * scale_n in its order: equal floats. Row
    tiles and K tails (K % 64, K % 16) included."""
    w = int_weight(n, k, bits=8, group_size=-1, seed=8)
    spec = int_spec(w, int8_activations=True)
    kernel = CpuW8A8Kernel()
    tensors = kernel.prepare(w, spec, Target.CPU)
    layer = _bound(kernel, tensors, spec)
    assert describe_linear(layer, round_io=False, op_rounding=False).struct.kind == native_decode.W_W8A8
    gen = torch.Generator().manual_seed(9)
    for m in (1, 3, 4, 7):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16).float()
        xq, xs = quantize_per_token_int8(x)
        sums = (xq.long() @ tensors["qweight"].long().T).float()  # exact: |sum| < 2^24
        want = sums * xs[:, None] * tensors["scales"].float() + tensors["bias"]
        assert torch.equal(_native_apply(layer, x), want), m


@pytest.mark.parametrize("n,k", [(576, 1536), (100, 40)])
def test_int8_and_dense_rows_match_the_weight(isa: str, n: int, k: int) -> None:
    """cpu_int8 (its activations quantized per token to int16, integer sums) and dense (fp32, bf16 and
    fp16 weights), including row and K tails the vector bodies leave to the scalar loop, and batches
    past the last whole token tile."""
    gen = torch.Generator().manual_seed(5)
    w8 = int_weight(n, k, bits=8, group_size=-1, seed=6)
    spec8 = int_spec(w8)
    int8 = CpuInt8Kernel()
    dense_spec = LinearSpec(name="model.layers.0.mlp.down_proj", scheme="dense", n=n, k=k, has_bias=True)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    dense = DenseKernel()
    cases = [
        (int8, int8.prepare(w8, spec8, Target.CPU), spec8),
        (dense, dense.prepare(DenseWeight(w, bias), dense_spec, Target.CPU), dense_spec),
        (dense, {"weight": w.to(torch.bfloat16), "bias": bias}, dense_spec),
        (dense, {"weight": w.to(torch.float16), "bias": bias}, dense_spec),  # a tied fp16 embedding
    ]
    for kernel, tensors, spec in cases:
        layer = KernelLinear(spec.name)
        layer.kernel, layer.spec, layer.tensors = kernel, spec, tensors
        for m in (1, 4, 7):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).float()
            want = (
                x @ tensors["weight"].float().T + bias
                if kernel is dense
                else _reference(kernel, tensors, spec, _int16_activations(x))
            )
            got = _native_apply(layer, x)
            assert rel_err(got, want) < NATIVE_GEMM_REL_ERR, (kernel.name, m, rel_err(got, want))


# ---- models ------------------------------------------------------------------------------------


def _gguf_artifact(
    tmp_path: Path, *, head: str | None, act: str, int8_activations: bool = False
) -> LoadedModel:
    """A tiny Llama in GGUF Q4_0 / Q4_1 (cpu_int4, symmetric and with float minimums) loaded with
    `act` activations (forced: the dtype this CPU would pick is the other machine kind's test too);
    `head`: --quantize-head (cpu_int8), else the tied F16 embedding (--quantize-head none);
    `int8_activations`: --[no-]int8-activations (cpu_w4a8 for the 4-bit layers)."""
    model = tiny_hf_model(
        "llama", seed=2, vocab_size=VOCAB_SIZE, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, model, GGUF_TYPES)
    request = ConversionRequest(
        str(path), ["cpu"], out=str(tmp_path / "out"), quantize_head=head or "none",  # type: ignore[arg-type]
        int8_activations=int8_activations,
    )  # fmt: skip
    [result] = convert(request)
    loaded = load_model(result.uri, cpu_act_dtype=act)  # type: ignore[arg-type]
    assert loaded.dtype == getattr(torch, act)
    return loaded


def _caches(lm: LoadedModel, kv: str, max_len: int = 160) -> tuple[KVCache, KVCache]:
    cfg = lm.config
    lm.model.setup(lm.dtype, max_len, "cpu")

    def make() -> KVCache:
        cache = KVCache(
            num_layers=cfg.num_layers, num_slots=4, max_len=max_len, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=lm.dtype, kv_cache_dtype=kv,  # type: ignore[arg-type]
        )  # fmt: skip
        cache.k_scale = [0.05] * cfg.num_layers
        cache.v_scale = [0.04] * cfg.num_layers
        return cache

    return make(), make()


def _native(lm: LoadedModel, cache: KVCache) -> NativeDecoder:
    _lib()
    decoder = native_decoder(lm.model, cache, threads=2, spin_us=100)
    assert decoder is not None
    return decoder


def _compare_decodes(
    lm: LoadedModel, kv: str, atol: float, mean_atol: float, cache_mismatch: float = FP8_CACHE_MISMATCH
) -> None:
    """Prefill slots 0, 1 and 3 to different lengths, then decode steps of every batch shape
    (one sequence, all three, a non-contiguous pair) on both caches; logits and cache bytes agree."""
    eager_cache, native_cache = _caches(lm, kv)
    decoder = _native(lm, native_cache)
    gen = torch.Generator().manual_seed(7)
    lengths = {0: 9, 1: 30, 3: 17}
    with torch.inference_mode():
        for slot, n in lengths.items():
            ids = torch.randint(0, 250, (n,), generator=gen)
            for cache in (eager_cache, native_cache):
                lm.model.prefill(ids, slot, cache)
        schedule = [[1], [0, 1, 3], [0, 3], [3], [0, 1, 3], [1, 3]] * 4
        for slots in schedule:
            tokens = torch.randint(0, 250, (len(slots),), generator=gen)
            positions = [lengths[s] for s in slots]
            want = lm.model.decode(tokens, slots, positions, eager_cache)
            got = decoder.decode(tokens, slots, positions, native_cache)
            assert got.shape == want.shape
            diff = (got - want).abs()
            assert diff.max().item() <= atol and diff.mean().item() <= mean_atol, (slots, diff.max().item())
            for s in slots:
                lengths[s] += 1
        if kv == "fp8":  # the same bytes: both round to e4m3 from values within an ulp of each other
            mismatched = (
                (eager_cache.data.view(torch.uint8) != native_cache.data.view(torch.uint8)).float().mean()
            )
            assert mismatched.item() < cache_mismatch


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize(
    "fixture", ["llama_artifact", "qwen2_artifact", "smollm2_artifact", "mistral_artifact"]
)
def test_native_logits_match_eager_fp32(
    fixture: str, kv: str, isa: str, request: pytest.FixtureRequest
) -> None:
    """Llama (GQA, llama3 rope), Qwen2 (qkv bias), SmolLM2-like (tied head), Mistral: dense fp32."""
    _, path = request.getfixturevalue(fixture)
    atol = FP32_FP8_MODEL_LOGITS_ATOL if kv == "fp8" else FP32_MODEL_LOGITS_ATOL
    _compare_decodes(load_model(path), kv, atol, FP32_MODEL_LOGITS_ATOL)


def test_native_logits_match_eager_qwen3(tmp_path: Path, isa: str) -> None:
    """Qwen3: a per-head RMSNorm on every q and k head before RoPE."""
    artifact = write_artifact(tiny_hf_model("qwen3"), tmp_path)
    _compare_decodes(load_model(artifact), "auto", FP32_MODEL_LOGITS_ATOL, FP32_MODEL_LOGITS_ATOL)


def _kernels(lm: LoadedModel) -> set[str]:
    return {m.kernel.name for m in lm.model.linear_layers().values() if m.kernel is not None}


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("head", [None, "int8"])
def test_native_logits_match_eager_int4(
    tmp_path: Path, head: str | None, kv: str, act: str, isa: str
) -> None:
    """cpu_int4 layers (Q4_0 symmetric, Q4_1 float minimums) in bf16 and in fp32 activations (where
    torch's int4 op still takes and returns bf16: the step rounds there too); the LM head the tied
    bf16 embedding or cpu_int8 (--quantize-head int8)."""
    lm = _gguf_artifact(tmp_path, head=head, act=act)
    kernels = _kernels(lm)
    assert "cpu_int4" in kernels and (head is None or "cpu_int8" in kernels), kernels
    _compare_decodes(lm, kv, *BF16_MODEL_LOGITS)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("head", [None, "int8"])
def test_native_logits_match_eager_w4a8(
    tmp_path: Path, head: str | None, kv: str, act: str, isa: str
) -> None:
    """--int8-activations: cpu_w4a8 layers (the same activation quantization in both steps)."""
    lm = _gguf_artifact(tmp_path, head=head, act=act, int8_activations=True)
    kernels = _kernels(lm)
    assert "cpu_w4a8" in kernels and "cpu_int4" not in kernels, kernels
    assert ("cpu_int8" in kernels) == (head == "int8"), kernels  # the head keeps 16-bit activations
    if kv == "fp8":
        _compare_decodes(lm, kv, *W4A8_FP8_MODEL_LOGITS, W4A8_FP8_CACHE_MISMATCH)
    else:
        _compare_decodes(lm, kv, *BF16_MODEL_LOGITS)


@pytest.mark.parametrize(
    "head,act",
    [(None, "float32"), ("int8", "float32"), ("int8", "bfloat16")],
    ids=["fp32", "int8head-fp32", "int8head-bf16"],
)
def test_native_logits_match_eager_w8a8(tmp_path: Path, head: str | None, act: str, isa: str) -> None:
    """A compressed-tensors W8A8 checkpoint (int8 activations declared): cpu_w8a8 layers, which the
    step runs bit for bit as the kernel's torch path. Its dense fp32 head keeps the model in fp32;
    with --quantize-head int8 (cpu_int8) it runs in bf16 too."""
    src = write_checkpoint(tmp_path / "src", "ct-int8")
    request = ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out"), quantize_head=head)  # type: ignore[arg-type]
    [result] = convert(request)
    lm = load_model(result.uri, with_tokenizer=False, cpu_act_dtype=act)  # type: ignore[arg-type]
    assert lm.dtype == getattr(torch, act)
    assert "cpu_w8a8" in _kernels(lm), _kernels(lm)
    _compare_decodes(lm, "auto", *INT8_ACT_MODEL_LOGITS)


# ---- serving -------------------------------------------------------------------------------------


def _serve(lm: LoadedModel, decode_step: str, monkeypatch: pytest.MonkeyPatch, kv: str) -> dict[str, list]:
    """Run a schedule of requests through an Engine: three join at once, a fourth joins while they
    run, one is aborted mid-way, one runs to a long context. Per request: (tokens, logprobs)."""
    monkeypatch.setenv("KILN_DECODE_STEP", decode_step)
    from runtime import settings as settings_module

    monkeypatch.setattr(settings_module, "_current", None)
    lm = replace(lm, kv_cache_dtype=kv) if kv != lm.kv_cache_dtype else lm
    engine = Engine(lm, max_num_seqs=4, max_model_len=400)
    assert (engine.decode.__self__.__class__ is NativeDecoder) == (decode_step == "native")
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    long = SamplingParams(max_tokens=300, temperature=0.0, logprobs=2, ignore_eos=True)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 12, 33, 8, 20)]
    results: dict[str, list] = {}
    for i in range(3):
        engine.add_request(f"r{i}", prompts[i], long if i == 1 else params)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got = results.setdefault(out.request_id, [[], []])
            got[0].extend(out.new_token_ids)
            got[1].extend(lp.logprob for lp in (out.logprobs or []))
        steps += 1
        if steps == 4:
            engine.add_request("r3", prompts[3], params)
        if steps == 6:
            engine.abort("r2")
        if steps == 9:
            engine.add_request("r4", prompts[4], params)
    return results


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_answers_the_same_natively_and_eagerly(
    smollm2_artifact: tuple[object, Path], monkeypatch: pytest.MonkeyPatch, kv: str
) -> None:
    """fp32 activations, so that both steps' greedy choices are the same (bf16 ones may flip where a
    random tiny model has near ties; the logits tests above bound bf16 models)."""
    _lib()
    lm = load_model(smollm2_artifact[1])
    eager = _serve(lm, "eager", monkeypatch, kv)
    native = _serve(lm, "native", monkeypatch, kv)
    assert eager.keys() == native.keys() == {f"r{i}" for i in range(5)}
    assert len(native["r1"][0]) == 300  # a context of 333 positions
    for rid in eager:
        assert native[rid][0] == eager[rid][0], rid
        got, want = torch.tensor(native[rid][1]), torch.tensor(eager[rid][1])
        assert (got - want).abs().max().item() <= LOGPROB_ATOL, rid


# ---- fallback ------------------------------------------------------------------------------------


def test_models_the_step_does_not_cover_decode_eagerly(
    llama_artifact: tuple[object, Path], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sliding-window layer (here: forced on a Llama) keeps the eager step, said in one log line;
    so does a machine where the library cannot be built."""
    lm = load_model(llama_artifact[1])
    cache, _ = _caches(lm, "auto")
    attn = lm.model.layers[0].self_attn
    monkeypatch.setattr(attn, "window", 16)
    with caplog.at_level(logging.INFO, logger=native_decode.__name__):
        assert native_decoder(lm.model, cache, threads=1, spin_us=0) is None
    assert any("eager step (layer 0 has a sliding window" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    monkeypatch.setattr(LIBRARY, "_state", {"lib": None})
    assert native_decoder(lm.model, cache, threads=1, spin_us=0) is None


def test_a_forked_child_steps_alone(llama_artifact: tuple[object, Path]) -> None:
    """After fork the child has none of the pool's threads: it decodes on its own, as the parent
    does with its pool, to the same logits."""
    import os

    lm = load_model(llama_artifact[1])
    _, cache = _caches(lm, "auto")
    decoder = _native(lm, cache)
    tokens = torch.tensor([3, 4])
    with torch.inference_mode():
        lm.model.prefill(torch.arange(1, 9), 0, cache)
        lm.model.prefill(torch.arange(1, 5), 2, cache)
        cache_before = cache.data.clone()
        want = decoder.decode(tokens, [0, 2], [8, 4], cache)
        cache.data.copy_(cache_before)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: exits without returning into pytest
            code = 1
            try:
                got = decoder.decode(tokens, [0, 2], [8, 4], cache)
                code = 0 if torch.equal(got, want) else 2
            finally:
                os.write(write, bytes([code]))
                os._exit(0)
        os.close(write)
        status = os.read(read, 1)
        os.waitpid(pid, 0)
    assert status == b"\x00"


def test_out_of_range_slots_positions_and_tokens_are_refused(llama_artifact: tuple[object, Path]) -> None:
    """The library indexes the cache and the embedding unchecked: the decoder refuses first."""
    lm = load_model(llama_artifact[1])
    _, cache = _caches(lm, "auto", max_len=32)
    decoder = _native(lm, cache)
    ok = torch.tensor([3])
    with torch.inference_mode():
        for tokens, slots, positions, what in (
            (ok, [4], [0], "slots"),
            (ok, [0], [32], "positions"),
            (ok, [0], [-1], "positions"),
            (torch.tensor([lm.config.vocab_size]), [0], [0], "tokens"),
        ):
            with pytest.raises(IndexError, match=what):
                decoder.decode(tokens, slots, positions, cache)
