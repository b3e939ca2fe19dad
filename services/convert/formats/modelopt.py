"""NVIDIA ModelOpt checkpoints (docs/formats.md §5.5), vLLM's modelopt / modelopt_fp4 / modelopt_mixed
methods.

The config is config.json `quantization_config` (ModelOpt >= 0.31: quant_method "modelopt", `quant_algo`,
`ignore`, `group_size`, `kv_cache_scheme`) or hf_quant_config.json (ModelOpt <= 0.29: `producer.name`
"modelopt", `quantization.{quant_algo, group_size, exclude_modules, kv_cache_quant_algo}`). Per Linear:

    FP8                        weight (N, K) F8_E4M3, weight_scale () F32 per checkpoint module
    FP8_PER_CHANNEL_PER_TOKEN  weight (N, K) F8_E4M3, weight_scale (N,) F32
    FP8_PB_WO                  weight (N, K) F8_E4M3, weight_scale (ceil(N/128), 1, K/128, 1) F32
    NVFP4, W4A16_NVFP4         weight (N, K/2) U8 packed E2M1, weight_scale (N, K/16) F8_E4M3,
                               weight_scale_2 () F32 a global MULTIPLIER (amax / (6 * 448))
Every scale is a multiplier. Static `input_scale`s are not used (the kernels quantize activations
dynamically). MIXED_PRECISION names each quantized module's algo in `quantized_layers`; modules it
does not list are dense. Exclusion follows vLLM's `is_layer_excluded`, on the vLLM layer name (the
fused qkv_proj / gate_up_proj, the experts module): an entry equal to a shard's name, contained in the
layer name, or an fnmatch glob of it; "x*" (not "x.*") first becomes "x" and "x.*" as vLLM rewrites it.
"""

from __future__ import annotations

from typing import Any

import re2
import torch

from kernels.base import Fp4Weight, Fp8Weight, SourceWeight
from kernels.codecs.fp4 import unpack_fp4
from kernels.errors import UnsupportedError
from runtime.model_layout import CLASS_EXPERT, LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError, TensorLayoutError
from services.convert.formats.base import (
    DENSE,
    SUPPORTED_FORMATS_MESSAGE,
    CheckpointFormat,
    LayerQuant,
    cfg_dict,
    cfg_int,
    cfg_list,
    fp4_quant,
)
from services.convert.limits import MAX_CONFIG_ENTRIES
from services.convert.patterns import REGEX_PREFIX, PatternCompiler

FMT = "ModelOpt"
FP8_BLOCK = (128, 128)
NVFP4_GROUP = 16
ALGOS: dict[str, LayerQuant] = {
    "FP8": LayerQuant("fp8", bits=8, fp8_strategy="tensor"),
    "FP8_PER_CHANNEL_PER_TOKEN": LayerQuant("fp8", bits=8, fp8_strategy="channel"),
    "FP8_PB_WO": LayerQuant("fp8", bits=8, fp8_strategy="block", block_size=FP8_BLOCK),
    "NVFP4": fp4_quant("nvfp4", fp4_activations=True),
    "W4A16_NVFP4": fp4_quant("nvfp4"),
}
MIXED = "MIXED_PRECISION"
STORED_DTYPE = {"fp8": "F8_E4M3", "fp4": "U8"}
GLOB_CHARS = ("*", "?", "[")


def _glob_regex(pattern: str) -> str:
    """fnmatch's pattern language (*, ?, [seq], [!seq]) as an RE2 expression of the whole name."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i + (pattern[i : i + 1] == "!")
            j += pattern[j : j + 1] == "]"
            end = pattern.find("]", j)
            if end < 0:
                out.append(r"\[")
                continue
            body = pattern[i:end].replace("\\", "\\\\")
            i = end + 1
            if body.startswith("!"):
                body = "^" + body[1:]
            elif body.startswith("^"):
                body = "\\" + body
            out.append(f"[{body}]")
        else:
            out.append(re2.escape(c))
    return "(?s:" + "".join(out) + r")\z"


def _vllm_exclude_list(entries: list[str]) -> list[str]:
    """vLLM's `apply_vllm_mapper` rewrite: "module_path*" means the module and its subtree."""
    out: list[str] = []
    for e in entries:
        out += [e[:-1], e[:-1] + ".*"] if len(e) >= 2 and e[-1] == "*" and e[-2] != "." else [e]
    return out


def _algo(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise QuantConfigError(f"{FMT} quantization config {where} must be a non-empty string, got {value!r}")
    return value.upper()


def _group_size(q: dict[str, Any], where: str) -> int:
    """`group_size` (absent or null: NVFP4's 16, as vLLM defaults it)."""
    return NVFP4_GROUP if q.get("group_size") is None else cfg_int(q, "group_size", where)


def _refuse(algo: str, where: str) -> UnsupportedError:
    return UnsupportedError(
        f"{FMT} quant_algo {algo!r} ({where}) is not supported. {SUPPORTED_FORMATS_MESSAGE}"
    )


class ModelOptFormat(CheckpointFormat):
    name = "modelopt"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        legacy = "quantization" in q
        body = cfg_dict(q, "quantization", FMT) if legacy else q
        self.algo = _algo(body.get("quant_algo"), "quant_algo")
        self.exclude_key = exclude_key = "exclude_modules" if legacy else "ignore"
        entries = cfg_list(body, exclude_key, FMT)
        if len(entries) > MAX_CONFIG_ENTRIES:
            raise QuantConfigError(
                f"{FMT} quantization config {exclude_key}: {len(entries)} entries, over Kiln's cap of "
                f"{MAX_CONFIG_ENTRIES} (services/convert/limits.py); use glob patterns for long lists"
            )
        if not all(isinstance(e, str) for e in entries):
            raise QuantConfigError(
                f"{FMT} quantization config {exclude_key} must list strings, got {entries!r}"
            )
        self.exclude = _vllm_exclude_list(entries)
        self.exclude_exact = frozenset(self.exclude)
        patterns = PatternCompiler(FMT)
        globs = [e for e in dict.fromkeys(self.exclude) if any(c in e for c in GLOB_CHARS)]
        self.exclude_globs = patterns.names([REGEX_PREFIX + _glob_regex(g) for g in globs], exclude_key)
        self.pattern_count = patterns.count
        self._excluded: dict[str, bool] = {}
        group_size = _group_size(body, FMT)
        self.layers: dict[str, LayerQuant] = {}
        self.quant: LayerQuant | None = None
        if self.algo == MIXED:
            self.layers = self._mixed(cfg_dict(body, "quantized_layers", FMT))
        else:
            self.quant = self._quant(self.algo, group_size, "quant_algo")
            if self.algo == "NVFP4" and self._weight_only(q):
                self.quant = ALGOS["W4A16_NVFP4"]
        self._add_notes(body, legacy)

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> ModelOptFormat | None:
        if quantization is None:
            return None
        method = str(quantization.get("quant_method", "")).lower()
        producer = quantization.get("producer")
        inner = quantization.get("quantization")
        tagged = (isinstance(producer, dict) and producer.get("name") == "modelopt") or (
            isinstance(inner, dict) and "modelopt_quant_config" in inner
        )
        return cls(ckpt, quantization) if method.startswith("modelopt") or tagged else None

    def _quant(self, algo: str, group_size: int, where: str) -> LayerQuant:
        if algo not in ALGOS:
            raise _refuse(algo, where)
        quant = ALGOS[algo]
        if quant.scheme == "fp4" and group_size != NVFP4_GROUP:
            raise UnsupportedError(
                f"{FMT} {algo} with group_size {group_size} ({where}) is not supported: NVFP4 scales "
                f"groups of {NVFP4_GROUP}. {SUPPORTED_FORMATS_MESSAGE}"
            )
        return quant

    def _mixed(self, layers: dict[str, Any]) -> dict[str, LayerQuant]:
        if not layers:
            raise QuantConfigError(f"{FMT} {MIXED} needs a non-empty `quantized_layers` object")
        out: dict[str, LayerQuant] = {}
        for module, recipe in layers.items():
            where = f"quantized_layers[{module!r}]"
            if not isinstance(recipe, dict):
                raise QuantConfigError(f"{FMT} quantization config {where} must be an object, got {recipe!r}")
            algo = _algo(recipe.get("quant_algo"), f"{where}.quant_algo")
            out[module] = self._quant(algo, _group_size(recipe, f"{FMT} {where}"), where)
        return out

    @staticmethod
    def _weight_only(q: dict[str, Any]) -> bool:
        """vLLM reads NVFP4 whose config_groups all declare no input activations as W4A16_NVFP4."""
        groups = q.get("config_groups")
        return (
            isinstance(groups, dict)
            and bool(groups)
            and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values())
        )

    def _add_notes(self, body: dict[str, Any], legacy: bool) -> None:
        quants = [self.quant] if self.quant else list(self.layers.values())
        if any(lq.scheme == "fp8" for lq in quants):
            self.notes.append(
                f"{FMT} FP8: static input_scale tensors are not used; the kernels quantize activations "
                "dynamically"
            )
        if any(lq.fp4_activations for lq in quants):
            self.notes.append(
                f"{FMT} NVFP4 (W4A4): input_scale tensors are not used; kernels without FP4 activation "
                "math run the layers with 16-bit activations (W4A16)"
            )
        kv = body.get("kv_cache_quant_algo") if legacy else body.get("kv_cache_scheme")
        if kv is not None and not isinstance(kv, str if legacy else dict):
            field = "kv_cache_quant_algo" if legacy else "kv_cache_scheme"
            want = "a string" if legacy else "an object"
            raise QuantConfigError(f"{FMT} quantization config {field} must be {want}, got {kv!r}")
        if kv:
            self.notes.append(
                f"{FMT} KV-cache quantization {kv!r} is not carried over: its k/v scales are not used; the "
                "runtime picks the KV-cache dtype"
            )

    def _is_excluded(self, module: str, layout: LinearLayout) -> bool:
        if module in self.exclude_exact:
            return True
        # vLLM matches the name of its layer: the fused qkv_proj / gate_up_proj, the experts module
        prefix = layout.name.rsplit(".", 1)[0] if layout.layer_class == CLASS_EXPERT else layout.name
        if prefix not in self._excluded:
            hit = any(e in prefix for e in self.exclude) or self.exclude_globs.matches(prefix)
            self._excluded[prefix] = hit
        return self._excluded[prefix]

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        weight = f"{module}.weight"
        dtype = self.ckpt.info(weight).dtype
        stored_quantized = dtype in STORED_DTYPE.values() or self.ckpt.has(f"{module}.weight_scale")
        excluded = self._is_excluded(module, layout)
        want: LayerQuant | None
        if excluded:
            want = None
        elif self.quant is None:
            want = self.layers.get(module) or self.layers.get(layout.name)
        elif stored_quantized or not layout.full_precision:
            want = self.quant
        else:
            want = None  # lm_head and MoE routers stored 16-bit stay so (ModelOpt's default)
        if want is None:
            if stored_quantized:
                why = f"matched by {self.exclude_key}" if excluded else "not listed in quantized_layers"
                raise ConversionError(
                    f"{module} is stored quantized ({weight} is {dtype}) but is {why} in the {FMT} "
                    "config; fix the config or re-export the checkpoint"
                )
            return DENSE
        expected = STORED_DTYPE[want.scheme]
        if dtype != expected:
            field = "quantized_layers" if self.quant is None else self.exclude_key
            raise ConversionError(
                f"{weight} is {dtype}, not {expected}, but the {FMT} config quantizes {module} as "
                f"{want.describe()}; fix its {field} or re-export the checkpoint"
            )
        return want

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        if lq.scheme == "fp4":
            return ("weight", "weight_scale", "weight_scale_2")
        if lq.scheme == "fp8":
            return ("weight", "weight_scale")
        return ("weight",)

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        weight = tensors[f"{module}.weight"]
        scale = tensors[f"{module}.weight_scale"]
        if lq.scheme == "fp4":
            scale_2 = tensors[f"{module}.weight_scale_2"]
            if scale_2.numel() != 1:
                raise TensorLayoutError(
                    f"{module}.weight_scale_2 must hold one global scale, got {tuple(scale_2.shape)}"
                )
            return Fp4Weight(unpack_fp4(weight), scale, "nvfp4", scale_2.float().reshape(1))
        if lq.fp8_strategy == "tensor":
            if scale.numel() != 1:
                raise TensorLayoutError(
                    f"{module}.weight_scale must hold one per-tensor scale, got {tuple(scale.shape)}"
                )
            return Fp8Weight(weight, scale.float().reshape(1), "tensor")
        if lq.fp8_strategy == "channel":
            return Fp8Weight(weight, scale.float().reshape(-1), "channel")
        if scale.dim() == 4 and scale.shape[1] == scale.shape[3] == 1:
            scale = scale[:, 0, :, 0]
        return Fp8Weight(weight, scale.float(), "block", block_size=lq.block_size)

    def describe(self) -> str:
        return f"{FMT} {self.algo}"
