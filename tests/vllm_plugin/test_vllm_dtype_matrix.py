"""vLLM serves every Kiln CPU artifact in every dtype it is asked for: source dtype {bf16, fp16, fp32}
× method {dense, online FP8, GPTQ, AWQ, W8A8, MoE GPTQ, MoE FP8} × vLLM --dtype {auto, bfloat16,
float32} (tests/vllm_plugin/dtype_matrix.py builds the checkpoints and artifacts).

Every cell loads the artifact through the plugin in vLLM's offline engine (one long-lived process,
tests/vllm_plugin/offline_host.py), generates, and scores a prompt; its prompt log-probabilities
are compared with

* vLLM serving the original checkpoint in the same dtype (same engine, same attention and residual
  stream; only the linear kernels differ), where vLLM's CPU build can serve it — which cells it
  cannot is VLLM_CPU_CANNOT (and, without AVX-512 / AMX, VLLM_CPU_CANNOT_WITHOUT_AVX512 / _AMX), each with
  the error it gives;
* the same artifact served by vLLM in float32: the dequantized model with fp32 numerics, the
  reference both bf16 paths are measured against (on the unquantized model it equals vLLM's fp32
  on the original exactly);
* `kiln serve`'s engine on the same artifact (residual stream and norms in fp32).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from devtools.builders.synthetic import write_checkpoint
from devtools.builders.tiny_artifacts import BOS_ID
from services.convert.library import ConversionRequest, convert
from tests.fixtures.checkpoints import WEIGHT_ONLY
from tests.vllm_plugin.dtype_matrix import (
    METHOD_SPECS,
    METHODS,
    SOURCE_DTYPES,
    VLLM_DTYPES,
    artifact,
    source_checkpoint,
)
from tests.vllm_plugin.vllm_host import OfflineHost, vllm_python

pytestmark = pytest.mark.vllm

PROMPT_IDS = [BOS_ID, *b"The quick brown fox jumps over the lazy dog; pack my box with five dozen jugs."]
MAX_TOKENS = 4

# Mean |Δ prompt log-probability| over the 78 scored prompt tokens (tiny random models: log-probs
# around -5.5). Measured on a Xeon with AVX-512 bf16 / AMX (2026-12-03), max over the matrix:
#   artifact vs original, same dtype:         0.0016 dense bf16, 0.0101 dense fp16-source bf16, 0.0065
#                                             fp16; quantized bf16 0.016-0.026 (GPTQ / AWQ / W8A8 /
#                                             MoE GPTQ): vLLM's own WNA16 kernel in bf16 is 2-3x
#                                             farther from the fp32 reference (0.017-0.025) than the
#                                             artifact's path (0.007-0.013), and W8A8's dynamic int8
#                                             activations flip codes with the input's rounding on
#                                             both sides (0.025 each from the reference).
#   artifact (vLLM, D) vs kiln serve:          fp32 0.0029; bf16 0.027; fp16 0.017 — vLLM keeps the
#                                             residual stream and norms in D, kiln serve in fp32:
#                                             the same as the artifact's own D-vs-fp32 difference.
VLLM_ORIGINAL_MEAN_ATOL = 0.03
# The plugin's path in D is no farther from the fp32 reference than vLLM's own path on the original.
NO_WORSE_THAN_VLLM_ATOL = 0.005
KILN_SERVE_MEAN_ATOL = {"float32": 0.01, "bfloat16": 0.04, "float16": 0.03}
# A router near-tie flips one expert for one token (max |Δ| up to 0.3 measured): MoE cells are
# bounded on the mean only, dense ones on the largest token too.
DENSE_MAX_ATOL = 0.15

# (method, vLLM dtype) -> what vLLM 0.32's CPU build does with the original checkpoint (a substring
# of its error). Anything else must load; a cell listed here that loads is compared like any other.
VLLM_CPU_CANNOT: dict[tuple[str, str], str] = {
    **{("fp8-online", d): "static_scaled_fp8_quant" for d in ("bfloat16", "float16")},
    ("fp8-online", "float32"): "float32 is not supported for quantization method fp8",
    ("gptq", "float32"): "cpu_gemm_wna16",
    ("moe-gptq", "float32"): "cpu_gemm_wna16",
    ("awq", "float32"): "float32 is not supported for quantization method awq",
    ("w8a8", "float32"): "int8_scaled_mm_with_quant",
    ("w8a8", "float16"): "vLLM died",  # its int8 GEMM hands fp16 attention bf16: a C++ abort
    **{("moe-fp8", d): "Unsupported FP8 MoE backend" for d in ("bfloat16", "float16", "float32")},
}

# Without AVX-512, vLLM 0.32's CPU build has no WNA16 GEMM (`cpu_gemm_wna16`), so the original GPTQ /
# AWQ checkpoints fail in every dtype (the artifacts, served through the plugin, run); its W8A8 path
# then loads in every dtype but lands 0.062 from the fp32 reference, where the plugin's is 0.026 (an
# AMD EPYC, AVX2 only, 2026-12-03).
VLLM_CPU_CANNOT_WITHOUT_AVX512: dict[str, str] = {"gptq": "cpu_gemm_wna16", "awq": "cpu_gemm_wna16"}
# Its only x86 WNA16 MoE backend (CPUExpertsInt4) needs AMX tiles: on an AVX-512 AMD EPYC without
# AMX the original MoE-GPTQ checkpoint fails in every dtype too (2026-12-03).
VLLM_CPU_CANNOT_WITHOUT_AMX: dict[str, str] = {
    "moe-gptq": "No WNA16 MoE backend supports the deployment configuration",
}
VLLM_ORIGINAL_MEAN_ATOL_WITHOUT_AVX512 = {"w8a8": 0.08}


def has_avx512() -> bool:
    """Whether this CPU runs torch's AVX-512 kernels (read when a test asks, never at import)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def has_amx() -> bool:
    """Whether this CPU has AMX tiles, as vLLM's CPU MoE kernels ask torch (read when a test asks)."""
    return bool(torch.cpu._is_amx_tile_supported())


def vllm_cpu_errors(method: str, dtype: str) -> list[str]:
    """The errors vLLM's CPU build may stop with on the original checkpoint (empty: it must load)."""
    errors = [VLLM_CPU_CANNOT.get((method, dtype))]
    if not has_avx512():
        errors.append(VLLM_CPU_CANNOT_WITHOUT_AVX512.get(method))
    if not has_amx():
        errors.append(VLLM_CPU_CANNOT_WITHOUT_AMX.get(method))
    return [e for e in errors if e is not None]


def vllm_original_mean_atol(method: str) -> float:
    return (
        VLLM_ORIGINAL_MEAN_ATOL
        if has_avx512()
        else VLLM_ORIGINAL_MEAN_ATOL_WITHOUT_AVX512.get(method, VLLM_ORIGINAL_MEAN_ATOL)
    )


def job_id(kind: str, method: str, source: str, dtype: str) -> str:
    return f"{kind}:{method}:{source}:{dtype}"


ABORTS = {
    job_id("src", method, source, dtype)
    for (method, dtype), error in VLLM_CPU_CANNOT.items()
    if error == "vLLM died"
    for source in SOURCE_DTYPES
}


@dataclass
class MatrixRun:
    vllm: dict[str, dict[str, Any]]  # job id -> result
    kiln: dict[tuple[str, str], list[float]]  # (method, source dtype) -> prompt log-probs
    resolved: dict[tuple[str, str], str]  # (method, source dtype) -> vLLM's "auto"

    def result(self, kind: str, method: str, source: str, dtype: str) -> dict[str, Any]:
        return self.vllm[job_id(kind, method, source, dtype)]


def _load_jobs(method: str, source: str, dtypes: list[str]) -> list[dict[str, Any]]:
    art, src = artifact(method, source), source_checkpoint(method, source)
    jobs = []
    for dtype in dtypes:
        common = {"dtype": dtype, "prompt_token_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS}
        jobs.append({"id": job_id("art", method, source, dtype), "model": str(art), **common})
        jobs.append({
            "id": job_id("src", method, source, dtype), "model": str(src), "load_format": "auto",
            "quantization": METHOD_SPECS[method].vllm_quantization, **common,
        })  # fmt: skip
    return jobs


def _resolve_jobs(method: str, source: str) -> list[dict[str, Any]]:
    spec = {"dtype": "auto", "resolve_only": True}
    return [
        {"id": job_id("auto-art", method, source, "auto"), "model": str(artifact(method, source)), **spec},
        {
            "id": job_id("auto-src", method, source, "auto"), "model": str(source_checkpoint(method, source)),
            "load_format": "auto", "quantization": METHOD_SPECS[method].vllm_quantization, **spec,
        },
    ]  # fmt: skip


def _kiln_prompt_logprobs(path: Path) -> list[float]:
    from devtools.eval import runtime_logits_fn
    from runtime.loader import load_model

    ids = torch.tensor([PROMPT_IDS])
    logprobs = runtime_logits_fn(load_model(path, with_tokenizer=False))(ids)[0].float().log_softmax(-1)
    return [float(logprobs[i, PROMPT_IDS[i + 1]]) for i in range(len(PROMPT_IDS) - 1)]


# FP4 (llm-compressor NVFP4A16 / MXFP4A16 of the Qwen3-MoE source, bf16): vLLM's CPU build has no
# NVFP4 / MXFP4 kernel for the original checkpoints; the plugin serves their CPU artifacts (cpu_fp4).
FP4_SCHEMES = ("nvfp4-a16", "mxfp4-a16")
VLLM_CPU_FP4_ERRORS = {
    "nvfp4-a16": "Marlin FP4 not available",
    "mxfp4-a16": "Failed to find a kernel that can implement the MXFP4 linear layer",
}


def fp4_paths(scheme: str) -> tuple[Path, Path]:
    """(original checkpoint, CPU artifact) of an FP4 Qwen3-MoE."""
    from devtools.builders import moe, smollm2

    source = moe.build_quantized(moe.build_source("qwen3-moe-marlin"), scheme)
    return source, smollm2.build_artifact(source, "cpu")


def bf16_jobs(tag: str, paths: dict[str, tuple[Path, Path]], originals: set[str]) -> list[dict[str, Any]]:
    """A bfloat16 job per artifact (`<tag>-art:<scheme>`) and per original checkpoint named in
    `originals` (`<tag>-src:<scheme>`); `paths`: scheme -> (original, artifact)."""
    jobs = []
    common = {"dtype": "bfloat16", "prompt_token_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS}
    for scheme, (source, art) in paths.items():
        jobs.append({"id": f"{tag}-art:{scheme}", "model": str(art), **common})
        if scheme in originals:
            jobs.append({"id": f"{tag}-src:{scheme}", "model": str(source), "load_format": "auto", **common})
    return jobs


# Qwen2-MoE (a sigmoid-gated shared expert beside the routed ones): vLLM runs the shared expert as its
# own module over the plugin's linear layers. The bf16 original runs on vLLM's CPU build; the GPTQ
# original needs AMX (VLLM_CPU_CANNOT_WITHOUT_AMX), so its artifact is compared with kiln serve.
QWEN2_MOE_SCHEMES = ("bf16", "gptq-w4a16")


def qwen2_moe_paths(scheme: str) -> tuple[Path, Path]:
    """(original checkpoint, CPU artifact) of the Qwen2-MoE source or its llm-compressor GPTQ."""
    from devtools.builders import moe, smollm2

    source = moe.build_qwen2_moe()
    if scheme != "bf16":
        source = moe.build_quantized(source, scheme)
    return source, smollm2.build_artifact(source, "cpu", **WEIGHT_ONLY)


# DeepSeek-V3 (MLA, grouped sigmoid routing with the correction bias, a shared expert): vLLM's CPU MLA
# kernels take only DeepSeek's own latent width (512 + 64), hence the "deepseek-v3-vllm" source.
# vLLM's MLA layer still derives its absorbed matrices from kv_b_proj at load (its AMX path then
# drops kv_b_proj's weight): the artifact's derived W_UK_T / W_UV are Kiln's runtime's.
DEEPSEEK_SCHEMES = ("bf16",)


def deepseek_paths(scheme: str) -> tuple[Path, Path]:
    from devtools.builders import moe, smollm2

    source = moe.build_source("deepseek-v3-vllm")
    return source, smollm2.build_artifact(source, "cpu")


# gpt-oss (attention sinks, a sliding window, biased experts with the clamped SwiGLU): vLLM's model
# names its attention `….attn.` and its token embedding `model.embedding` (its hf_to_vllm_mapper,
# which the plugin applies to the artifact's names). The bf16 original runs on vLLM's CPU build; the
# native MXFP4 one needs a kernel vLLM's CPU build has only with AMX.
GPT_OSS_SCHEMES = ("bf16", "native-mxfp4")
VLLM_CPU_GPT_OSS_MXFP4_ERROR = "No MXFP4 MoE backend supports the deployment configuration"


def gpt_oss_paths(scheme: str) -> tuple[Path, Path]:
    from devtools.builders import moe, smollm2
    from devtools.builders.gpt_oss import build_gpt_oss_mxfp4

    source = moe.build_source("gpt-oss") if scheme == "bf16" else build_gpt_oss_mxfp4()
    return source, smollm2.build_artifact(source, "cpu")


def extra_jobs(tmp: Path) -> list[dict[str, Any]]:
    """The head-dtype override, an artifact for another target (refused before any read), the FP4
    artifacts with their originals and the Qwen2-MoE ones."""
    gpu_source = write_checkpoint(tmp / "gpu-src", "gptq")
    gpu_artifact = convert(ConversionRequest(str(gpu_source), ["sm80"], out=str(tmp / "gpu-out")))[0].uri
    return [
        *bf16_jobs("fp4", {s: fp4_paths(s) for s in FP4_SCHEMES}, set(FP4_SCHEMES)),
        *bf16_jobs("qwen2-moe", {s: qwen2_moe_paths(s) for s in QWEN2_MOE_SCHEMES}, {"bf16"}),
        *bf16_jobs("deepseek", {s: deepseek_paths(s) for s in DEEPSEEK_SCHEMES}, {"bf16"}),
        *bf16_jobs("gpt-oss", {s: gpt_oss_paths(s) for s in GPT_OSS_SCHEMES}, set(GPT_OSS_SCHEMES)),
        {
            "id": "head-fp32", "model": str(artifact("gptq", "float32")), "dtype": "bfloat16",
            "hf_overrides": {"head_dtype": "float32"}, "prompt_token_ids": PROMPT_IDS,
            "max_tokens": MAX_TOKENS,
        },
        {"id": "gpu-artifact", "model": gpu_artifact, "dtype": "bfloat16", "prompt_token_ids": PROMPT_IDS},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MatrixRun]:
    vllm_python()  # skips without the vLLM venv
    workdir = tmp_path_factory.mktemp("dtype-matrix")
    cells = [(m, s) for m in METHODS for s in SOURCE_DTYPES]
    host = OfflineHost(workdir)
    try:
        results = {r["id"]: r for r in host.run([job for m, s in cells for job in _resolve_jobs(m, s)])}
        resolved = {(m, s): results[job_id("auto-art", m, s, "auto")].get("dtype", "") for m, s in cells}
        jobs = [
            job
            for m, s in cells
            for job in _load_jobs(m, s, sorted({"bfloat16", "float32", resolved[(m, s)]} - {""}))
        ]
        # Jobs known to abort vLLM go last: the host would restart after each (≈12 s).
        jobs.sort(key=lambda job: job["id"] in ABORTS)
        results.update({r["id"]: r for r in host.run(jobs + extra_jobs(workdir))})
    finally:
        host.close()
    kiln = {(m, s): _kiln_prompt_logprobs(artifact(m, s)) for m, s in cells}
    yield MatrixRun(results, kiln, resolved)


def _mean(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _max(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("source", SOURCE_DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_auto_resolves_as_for_the_original_checkpoint(method: str, source: str, matrix: MatrixRun) -> None:
    """The artifact's config.json keeps the source's dtype, so `--dtype auto` picks for the artifact
    what it picks for the original (vLLM's rule: fp32 checkpoints run in bf16 on this CPU)."""
    art = matrix.result("auto-art", method, source, "auto")
    src = matrix.result("auto-src", method, source, "auto")
    assert art["ok"], art["error"]
    assert src["ok"], src["error"]
    assert art["dtype"] == src["dtype"] == ("bfloat16" if source == "float32" else source)


EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.embedding.weight", "lm_head.weight")  # vLLM's names


def _report_is_views_and_casts(report: dict[str, Any]) -> None:
    """Nothing transformed at load: every parameter is a view of the mapping, except norms cast to
    vLLM's dtype (a few KB) and embeddings padded to vLLM's 64-row multiple."""
    assert report["views"] + len(report["copied"]) == report["parameters"], report["not_views"][:5]
    assert report["changed_after_binding"] == [] and report["created_after_binding"] == []
    for copied in report["copied"]:
        norm_cast = "norm.weight (cast to " in copied
        embedding = copied.startswith(EMBEDDING_NAMES)
        padded = embedding and "(padded from" in copied
        assert norm_cast or padded, copied


@pytest.mark.parametrize("vllm_dtype", VLLM_DTYPES)
@pytest.mark.parametrize("source", SOURCE_DTYPES)
@pytest.mark.parametrize("method", METHODS)
def test_vllm_serves_the_artifact_in_its_dtype(
    method: str, source: str, vllm_dtype: str, matrix: MatrixRun
) -> None:
    dtype = matrix.resolved[(method, source)] if vllm_dtype == "auto" else vllm_dtype
    art = matrix.result("art", method, source, dtype)
    assert art["ok"], art["error"]
    assert art["dtype"] == dtype and art["head_dtype"] == dtype
    assert len(art["output_token_ids"]) == MAX_TOKENS
    assert all(lp <= 0.0 for lp in art["output_logprobs"] + art["prompt_logprobs"])
    _report_is_views_and_casts(art["report"])

    served = art["prompt_logprobs"]
    reference = matrix.result("art", method, source, "float32")["prompt_logprobs"]
    moe = method.startswith("moe-")
    kiln = matrix.kiln[(method, source)]
    vs_kiln = _mean(served, kiln)
    print(f"{method}/{source}/{dtype}: vs kiln serve mean {vs_kiln:.4f} max {_max(served, kiln):.3f}")
    assert vs_kiln <= KILN_SERVE_MEAN_ATOL[dtype]
    if not moe:
        assert _max(served, kiln) <= DENSE_MAX_ATOL

    original = matrix.result("src", method, source, dtype)
    if not original["ok"]:
        expected = vllm_cpu_errors(method, dtype)
        assert any(e in original["error"] for e in expected), original["error"][-2000:]
        return
    vs_original = _mean(served, original["prompt_logprobs"])
    err_plugin, err_vllm = _mean(served, reference), _mean(original["prompt_logprobs"], reference)
    print(
        f"{method}/{source}/{dtype}: vs vLLM on the original mean {vs_original:.4f}; from the fp32 "
        f"reference: plugin {err_plugin:.4f}, vLLM's own {err_vllm:.4f}"
    )
    assert vs_original <= vllm_original_mean_atol(method)
    assert err_plugin <= err_vllm + NO_WORSE_THAN_VLLM_ATOL


def test_a_head_dtype_override_runs_the_lm_head_in_it(matrix: MatrixRun) -> None:
    """`--hf-overrides '{"head_dtype": "float32"}'`: vLLM casts the unquantized lm_head itself, which
    it does only for a method it knows as unquantized (Kiln's embedding method is one)."""
    run = matrix.vllm["head-fp32"]
    assert run["ok"], run["error"]
    assert (run["dtype"], run["head_dtype"]) == ("bfloat16", "float32")
    plain = matrix.result("art", "gptq", "float32", "bfloat16")["prompt_logprobs"]
    assert _mean(run["prompt_logprobs"], plain) <= KILN_SERVE_MEAN_ATOL["bfloat16"]


@pytest.mark.parametrize("scheme", FP4_SCHEMES)
def test_vllm_serves_an_fp4_artifact_it_cannot_serve_from_the_original(
    scheme: str, matrix: MatrixRun
) -> None:
    """The plugin runs Kiln's cpu_fp4 expert and linear kernels inside vLLM on the artifact's bytes
    (views of the mapping); vLLM's CPU build refuses the original FP4 checkpoint."""
    art = matrix.vllm[f"fp4-art:{scheme}"]
    assert art["ok"], art["error"]
    assert len(art["output_token_ids"]) == MAX_TOKENS
    _report_is_views_and_casts(art["report"])
    kiln = _kiln_prompt_logprobs(fp4_paths(scheme)[1])
    vs_kiln = _mean(art["prompt_logprobs"], kiln)
    original = matrix.vllm[f"fp4-src:{scheme}"]
    print(f"{scheme}: vLLM plugin vs kiln serve mean {vs_kiln:.4f}; original: {original['error'][-300:]}")
    assert vs_kiln <= KILN_SERVE_MEAN_ATOL["bfloat16"]
    assert not original["ok"] and VLLM_CPU_FP4_ERRORS[scheme] in original["error"]


@pytest.mark.parametrize("scheme", QWEN2_MOE_SCHEMES)
def test_vllm_serves_a_qwen2_moe_artifact_with_its_shared_expert(scheme: str, matrix: MatrixRun) -> None:
    """The plugin's routed experts plus vLLM's own shared expert over the plugin's linear layers
    match kiln serve, and (bf16) vLLM serving the original checkpoint."""
    art = matrix.vllm[f"qwen2-moe-art:{scheme}"]
    assert art["ok"], art["error"]
    assert len(art["output_token_ids"]) == MAX_TOKENS
    _report_is_views_and_casts(art["report"])
    vs_kiln = _mean(art["prompt_logprobs"], _kiln_prompt_logprobs(qwen2_moe_paths(scheme)[1]))
    print(f"qwen2-moe {scheme}: vLLM plugin vs kiln serve mean {vs_kiln:.4f}")
    assert vs_kiln <= KILN_SERVE_MEAN_ATOL["bfloat16"]
    original = matrix.vllm.get(f"qwen2-moe-src:{scheme}")
    if original is not None:
        assert original["ok"], original["error"]
        vs_original = _mean(art["prompt_logprobs"], original["prompt_logprobs"])
        print(f"qwen2-moe {scheme}: vLLM plugin vs vLLM on the original mean {vs_original:.4f}")
        assert vs_original <= VLLM_ORIGINAL_MEAN_ATOL


@pytest.mark.parametrize("scheme", DEEPSEEK_SCHEMES)
def test_vllm_serves_a_deepseek_v3_artifact(scheme: str, matrix: MatrixRun) -> None:
    """MLA over the plugin's linear layers and Kiln's experts behind vLLM's grouped router (its
    correction bias bound to the artifact's), against kiln serve and vLLM on the original."""
    art = matrix.vllm[f"deepseek-art:{scheme}"]
    assert art["ok"], art["error"]
    assert len(art["output_token_ids"]) == MAX_TOKENS
    report = art["report"]
    # vLLM's MLA derives its absorbed matrices from kv_b_proj itself: on AMX machines it then drops
    # kv_b_proj's weight (replaced), elsewhere it adds W_UK_T / W_UV parameters of its own (created)
    replaced = report["changed_after_binding"]
    created = report["created_after_binding"]
    assert all(name.endswith(".self_attn.kv_b_proj.weight") for name in replaced), replaced
    assert all(name.endswith((".W_UK_T", ".W_UV")) for name in created), created
    bound = report["views"] + len(report["copied"]) + len(replaced) + len(created)
    assert bound == report["parameters"], report["not_views"]
    for copied in report["copied"]:
        assert (
            "norm.weight (cast to " in copied
            or "e_score_correction_bias (cast to float32)" in copied
            or (
                copied.startswith(("model.embed_tokens.weight", "lm_head.weight"))
                and "(padded from" in copied
            )
        ), copied
    vs_kiln = _mean(art["prompt_logprobs"], _kiln_prompt_logprobs(deepseek_paths(scheme)[1]))
    original = matrix.vllm[f"deepseek-src:{scheme}"]
    assert original["ok"], original["error"]
    vs_original = _mean(art["prompt_logprobs"], original["prompt_logprobs"])
    print(f"deepseek-v3 {scheme}: vLLM plugin vs kiln serve {vs_kiln:.4f}, vs the original {vs_original:.4f}")
    assert vs_kiln <= KILN_SERVE_MEAN_ATOL["bfloat16"]
    assert vs_original <= VLLM_ORIGINAL_MEAN_ATOL


@pytest.mark.parametrize("scheme", GPT_OSS_SCHEMES)
def test_vllm_serves_a_gpt_oss_artifact(scheme: str, matrix: MatrixRun) -> None:
    """vLLM's gpt-oss (its sinks, windows and router) over the plugin's linear layers and Kiln's
    biased swigluoai experts, keyed by vLLM's own names: against kiln serve, and vLLM on the
    original. vLLM's CPU build runs the native MXFP4 original only on CPUs with AMX (its MXFP4 MoE
    backend); elsewhere it refuses it and the plugin still serves the artifact."""
    art = matrix.vllm[f"gpt-oss-art:{scheme}"]
    assert art["ok"], art["error"]
    assert len(art["output_token_ids"]) == MAX_TOKENS
    _report_is_views_and_casts(art["report"])
    vs_kiln = _mean(art["prompt_logprobs"], _kiln_prompt_logprobs(gpt_oss_paths(scheme)[1]))
    original = matrix.vllm[f"gpt-oss-src:{scheme}"]
    print(f"gpt-oss {scheme}: vLLM plugin vs kiln serve {vs_kiln:.4f}")
    assert vs_kiln <= KILN_SERVE_MEAN_ATOL["bfloat16"]
    if scheme == "bf16" or original["ok"]:
        assert original["ok"], original["error"]
        vs_original = _mean(art["prompt_logprobs"], original["prompt_logprobs"])
        print(f"gpt-oss {scheme}: vLLM plugin vs vLLM on the original {vs_original:.4f}")
        assert vs_original <= VLLM_ORIGINAL_MEAN_ATOL
    else:
        assert not has_amx(), "vLLM refused the MXFP4 original on a CPU with AMX: " + original["error"]
        assert VLLM_CPU_GPT_OSS_MXFP4_ERROR in original["error"]


def test_an_artifact_for_a_gpu_is_refused_before_a_weight_is_read(matrix: MatrixRun) -> None:
    run = matrix.vllm["gpu-artifact"]
    assert not run["ok"]
    assert "TargetMismatchError: artifact built for sm80; this machine has no CUDA device" in run["error"]
    assert "convert with --target cpu" in run["error"]
