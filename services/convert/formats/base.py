"""The checkpoint-format contract: detect a format from its config, say how each layer is quantized,
and decode a layer's tensors into a canonical weight (kernels.base IntWeight / Fp8Weight / DenseWeight).

Built-ins: gptq, awq, fp8 (Fp8Config), compressed-tensors, dense. Third-party formats register a
`CheckpointFormat` subclass under the entry-point group `kiln.formats`; they are tried first.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from kernels.base import (
    E8M0_NAN,
    FP4_GROUP_SIZE,
    DenseWeight,
    Fp4Format,
    Fp4Weight,
    Fp8Weight,
    IntWeight,
    SourceWeight,
    weight_shape,
)
from kernels.errors import KilnError, LayoutError, UnsupportedError
from services.convert.errors import ConversionError, QuantConfigError, TensorLayoutError

if TYPE_CHECKING:
    from runtime.model_layout import LinearLayout
    from services.convert.checkpoint import Checkpoint

Scheme = Literal["int", "fp8", "fp4", "dense"]
FP4_ENCODINGS = {"nvfp4": "E2M1 + E4M3/16 + fp32 global", "mxfp4": "E2M1 + E8M0/32"}

SUPPORTED_FORMATS_MESSAGE = (
    "Kiln supports: GPTQ (2/4/8-bit, checkpoint_format gptq or gptq_v2, sym/asym, act-order), "
    "AutoRound (integer auto_round:auto_gptq / auto_awq packings), "
    "AWQ-GEMM 4-bit with zero points, bitsandbytes 4-bit (NF4 / FP4, double-quantized or not) and 8-bit "
    "(LLM.int8), compressed-tensors pack-quantized W4A16/W8A16 (sym/asym, "
    "act-order), float-quantized FP8 (tensor/channel/block) and int-quantized int8 (W8A16, or W8A8 "
    "with dynamic per-token int8 activations), Fp8Config FP8 (per-tensor or block), NVIDIA ModelOpt "
    "FP8 / FP8_PER_CHANNEL_PER_TOKEN / FP8_PB_WO / NVFP4 / W4A16_NVFP4 (and MIXED_PRECISION of those), "
    "AMD Quark FP8 (per-tensor / per-channel e4m3 weights), TorchAO IntxWeightOnly (int2-int8) / "
    "Int8WeightOnly, llama.cpp GGUF (Q4_0 / Q4_1 / Q5_0 / Q5_1 / "
    "Q8_0 / Q4_K / Q5_K / Q6_K, mixed as in Q4_K_M), "
    "and unquantized bf16/fp16/fp32 checkpoints (optionally quantized to FP8 online with --method fp8)"
)


@dataclass(frozen=True)
class LayerQuant:
    """How one checkpoint module is quantized (shards of a fused layer must have equal values)."""

    scheme: Scheme
    bits: int = 16
    group_size: int = -1
    symmetric: bool = True
    act_order: bool = False
    fp8_strategy: Literal["tensor", "channel", "block"] | None = None
    block_size: tuple[int, int] | None = None
    int8_activations: bool = False  # the checkpoint declares dynamic per-token symmetric int8 inputs
    float_zeros: bool = False  # a float minimum per group (w = q * s + m), not an integer zero point
    fp4_format: Fp4Format | None = None
    fp4_activations: bool = False  # a W4A4 checkpoint (FP4 activations declared)
    codebook: str = ""  # the codes index this value table (bitsandbytes "nf4" / "fp4"), stored per layer

    def spec_fields(self) -> dict[str, Any]:
        """The `kernels.base.LinearSpec` fields this quantization sets (each field has one name in both)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        if self.scheme == "dense":
            return "dense"
        if self.scheme == "fp4":
            assert self.fp4_format is not None
            acts = ", W4A4 source: activations run 16-bit" if self.fp4_activations else ""
            return f"{self.fp4_format} ({FP4_ENCODINGS[self.fp4_format]}{acts})"
        if self.scheme == "fp8":
            extra = f" {self.block_size[0]}x{self.block_size[1]}" if self.block_size else ""
            return f"fp8 {self.fp8_strategy}{extra}"
        g = "channel" if self.group_size in (-1, 0) else f"g{self.group_size}"
        if self.codebook:
            return f"{self.codebook} (int{self.bits} codes into a value table) {g}"
        parts = [
            f"int{self.bits}",
            g,
            "float-min" if self.float_zeros else "sym" if self.symmetric else "asym",
        ]
        if self.act_order:
            parts.append("act-order")
        if self.int8_activations:
            parts.append("int8 activations")
        return " ".join(parts)


DENSE = LayerQuant("dense")


def _bad(module: str, what: str) -> TensorLayoutError:
    return TensorLayoutError(
        f"layer {module}: {what}; its tensors disagree with each other or with the quantization config: "
        "fix the config or re-export the checkpoint"
    )


def fp4_quant(fmt: Fp4Format, *, fp4_activations: bool = False) -> LayerQuant:
    """The LayerQuant of an FP4 layer."""
    return LayerQuant(
        "fp4", bits=4, group_size=FP4_GROUP_SIZE[fmt], fp4_format=fmt, fp4_activations=fp4_activations
    )


def _check_fp4(module: str, w: Fp4Weight, n: int, k: int) -> None:
    gs = w.group_size
    if k % gs:
        raise _bad(module, f"{w.fmt} groups of {gs} do not divide K={k}")
    if tuple(w.scales.shape) != (n, k // gs):
        raise _bad(module, f"{w.fmt} scales are {tuple(w.scales.shape)}, expected (N={n}, K/{gs}={k // gs})")
    want = torch.float8_e4m3fn if w.fmt == "nvfp4" else torch.uint8
    if w.scales.dtype != want:
        raise _bad(module, f"{w.fmt} scales must be {want}, got {w.scales.dtype}")
    if w.codes.dtype != torch.uint8:
        raise _bad(module, f"FP4 codes must be uint8, got {w.codes.dtype}")
    if w.fmt == "nvfp4":
        shards = len(w.shard_sizes) or 1
        if w.global_scale is None or w.global_scale.numel() != shards:
            got = None if w.global_scale is None else tuple(w.global_scale.shape)
            raise _bad(module, f"NVFP4 needs one global scale per shard ({shards}), got {got}")


def _check_shapes(module: str, w: SourceWeight) -> None:
    """The canonical weight's tensors agree with each other (see kernels.base for the shapes)."""
    main = w.codes if isinstance(w, IntWeight | Fp4Weight) else w.weight
    if main.dim() != 2:
        raise _bad(module, f"weight must be 2-D (N, K), got {tuple(main.shape)}")
    n, k = weight_shape(w)
    if isinstance(w, Fp4Weight):
        _check_fp4(module, w, n, k)
    elif isinstance(w, IntWeight):
        gs = w.group_size
        if gs > 0 and k % gs:
            raise _bad(module, f"group_size {gs} does not divide K={k}")
        groups = 1 if gs in (-1, 0) else k // gs
        if tuple(w.scales.shape) != (groups, n):
            raise _bad(module, f"scales are {tuple(w.scales.shape)}, expected (G={groups}, N={n})")
        if w.zeros is not None and tuple(w.zeros.shape) != (groups, n):
            raise _bad(module, f"zero points are {tuple(w.zeros.shape)}, expected (G={groups}, N={n})")
        if w.mins is not None and tuple(w.mins.shape) != (groups, n):
            raise _bad(module, f"minimums are {tuple(w.mins.shape)}, expected (G={groups}, N={n})")
        if w.g_idx is not None:
            if tuple(w.g_idx.shape) != (k,):
                raise _bad(module, f"g_idx is {tuple(w.g_idx.shape)}, expected (K={k},)")
            if k and (int(w.g_idx.min()) < 0 or int(w.g_idx.max()) >= groups):
                raise _bad(
                    module,
                    f"g_idx values span [{int(w.g_idx.min())}, {int(w.g_idx.max())}], outside [0, {groups})",
                )
    elif isinstance(w, Fp8Weight):
        if w.strategy == "tensor":
            expected: tuple[int, ...] = (len(w.shard_sizes or (n,)),)
        elif w.strategy == "channel":
            expected = (n,)
        else:
            bn, bk = w.block_size or (0, 0)
            if bn <= 0 or bk <= 0:
                raise _bad(module, f"block FP8 needs a positive block size, got {w.block_size}")
            expected = (-(-n // bn), -(-k // bk))
        got = tuple(w.scale.shape) if w.strategy == "block" else (w.scale.numel(),)
        if got != expected:
            raise _bad(
                module,
                f"FP8 {w.strategy} scale is {tuple(w.scale.shape)} for a ({n}, {k}) weight, "
                f"expected {expected}" + (f" for block size {w.block_size}" if w.block_size else ""),
            )


def _check_scales(module: str, w: SourceWeight) -> None:
    """Scales must be finite (FP8 scales also non-zero): a NaN / inf / 0 scale makes the layer garbage."""
    if isinstance(w, Fp4Weight):
        _check_fp4_scales(module, w)
        return
    if isinstance(w, Fp8Weight):
        scale, name, zero_ok = w.scale, "weight scale", False
    elif isinstance(w, IntWeight):
        scale, name, zero_ok = w.scales, "scales", True
    else:
        return
    s = scale.float()
    bad = ~torch.isfinite(s) if zero_ok else ~torch.isfinite(s) | (s == 0)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        what = "non-finite" if zero_ok else "non-finite or zero"
        raise TensorLayoutError(
            f"layer {module}: {int(bad.sum())} {what} {name} (first at index {first}: {s[first].item()}); "
            "the checkpoint is corrupt — re-quantize or re-export it"
        )


def _check_fp4_scales(module: str, w: Fp4Weight) -> None:
    """Block scales finite (an E8M0 byte 255 is NaN), global scales finite and non-zero."""
    if w.fmt == "mxfp4":
        bad = w.scales == E8M0_NAN
        what = "E8M0 scale bytes of 255 (NaN)"
    else:
        bad = ~torch.isfinite(w.scales.float())
        what = "non-finite E4M3 scales"
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise TensorLayoutError(
            f"layer {module}: {int(bad.sum())} {what} (first at index {first}); the checkpoint is "
            "corrupt — re-quantize or re-export it"
        )
    if w.global_scale is not None:
        g = w.global_scale.float()
        if not bool(torch.isfinite(g).all()) or bool((g == 0).any()):
            raise TensorLayoutError(
                f"layer {module}: NVFP4 global scale {g.tolist()} is not finite and non-zero; the "
                "checkpoint is corrupt — re-quantize or re-export it"
            )


def _as_int(v: object) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"-?\d{1,12}", v.strip()):
        return int(v)
    return None


def cfg_int(q: dict[str, Any], key: str, fmt: str, default: int | None = None) -> int:
    """An integer field of a quantization config (QuantConfigError when missing or not an integer)."""
    v = q.get(key, default)
    if v is None:
        raise QuantConfigError(f"{fmt} quantization config lacks {key!r}; add it (an integer)")
    out = _as_int(v)
    if out is None:
        raise QuantConfigError(f"{fmt} quantization config field {key!r} must be an integer, got {v!r}")
    return out


def cfg_list(q: dict[str, Any], key: str, fmt: str) -> list[Any]:
    """A list field (absent / null -> [])."""
    v = q.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise QuantConfigError(f"{fmt} quantization config field {key!r} must be a list, got {v!r}")
    return v


def cfg_dict(q: dict[str, Any], key: str, fmt: str) -> dict[str, Any]:
    """An object field (absent / null -> {})."""
    v = q.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise QuantConfigError(f"{fmt} quantization config field {key!r} must be an object, got {v!r}")
    return v


class CheckpointFormat(ABC):
    """One checkpoint format. Instances are configured for one checkpoint by `detect`."""

    name: ClassVar[str]

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any] | None) -> None:
        self.ckpt = ckpt
        self.quantization = quantization
        self.notes: list[str] = []
        self.pattern_count = 0  # regular expressions from the config, matched against every module

    @classmethod
    @abstractmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> CheckpointFormat | None:
        """A configured instance if this checkpoint is in this format, else None.

        `quantization` is the quantization config found (config.json quantization_config /
        compression_config, or quantize_config.json / quant_config.json), `where` names its file.
        Raise UnsupportedError for a recognised but unsupported variant.
        """

    @abstractmethod
    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        """Quantization of checkpoint module `module` (a shard of runtime layer `layout`)."""

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        """Tensor suffixes this format stores for a layer with quantization `lq`."""
        return ("weight",)

    def source_tensors(self, module: str, lq: LayerQuant) -> list[str]:
        names = [f"{module}.{s}" for s in self.weight_suffixes(lq) if self.ckpt.has(f"{module}.{s}")]
        missing = [s for s in self.required_suffixes(lq) if not self.ckpt.has(f"{module}.{s}")]
        if missing:
            raise ConversionError(
                f"{module}: the checkpoint lacks {', '.join(f'{module}.{s}' for s in missing)} "
                f"required for a {self.name} {lq.describe()} layer"
            )
        if self.ckpt.has(f"{module}.bias"):
            names.append(f"{module}.bias")
        return names

    def required_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        return self.weight_suffixes(lq)

    def decode(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        """Canonical weight of one module (bias attached), from the tensors `source_tensors` named.

        Tensors that disagree with each other or with the config raise TensorLayoutError naming the
        module, whatever the codec raised (LayoutError, or torch's RuntimeError on a shape mismatch).
        """
        try:
            w = (
                DenseWeight(tensors[f"{module}.weight"])
                if lq.scheme == "dense"
                else self.decode_quantized(module, lq, tensors)
            )
        except (TensorLayoutError, QuantConfigError):
            raise
        except (LayoutError, RuntimeError, ValueError, IndexError, TypeError, KeyError) as e:
            raise TensorLayoutError(
                f"{self.name} layer {module}: {e}; its tensors disagree with each other or with the "
                f"quantization config ({lq.describe()}): fix the config or re-export the checkpoint"
            ) from e
        except KilnError:
            raise
        _check_shapes(module, w)
        _check_scales(module, w)
        w.bias = tensors.get(f"{module}.bias")
        return w

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        raise ConversionError(f"{self.name} cannot decode quantized layer {module}")

    def check_method(self, method: str) -> None:
        """Refuse a conversion method this checkpoint cannot take (`--method fp8` quantizes an
        unquantized checkpoint online; a quantized one keeps its quantization)."""
        if method == "fp8" and self.quantization is not None:
            raise UnsupportedError(
                f"--method fp8 quantizes an unquantized (bf16/fp16/fp32) checkpoint online, but "
                f"{self.ckpt.uri} is already quantized ({self.describe()}); use --method auto to keep "
                "its quantization"
            )

    def source_label(self, module: str) -> str:
        """How the plan names a layer's source encoding when its scheme alone does not say it
        (a GGUF block type); empty for most formats."""
        return ""

    def describe(self) -> str:
        return self.name
