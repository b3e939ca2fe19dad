"""compressed-tensors checkpoints (llm-compressor; docs/formats.md §3, vLLM's CompressedTensorsConfig rules).

Supported schemes: pack-quantized int 4/8-bit weight-only (group/channel, sym/asym, actorder
"group"), FP4 (nvfp4-pack-quantized: float 4-bit, strategy tensor_group, group 16, E4M3 scales and a
global scale stored as a divisor; mxfp4-pack-quantized: float 4-bit, strategy group, group 32, E8M0
scale bytes; chosen by the weight args as vLLM does, W4A4 activations run 16-bit), float-quantized
FP8 weights (tensor/channel/block; activation settings are dropped, the
kernels quantize activations dynamically) and int-quantized / naive-quantized int8 weights: W8A8 with
dynamic per-token symmetric int8 activations where the config declares them (SmoothQuant-style W8A8;
weight-only kernels run such layers as W8A16), else W8A16. `ignore` entries are exact names or
`re:` regexes (re.match semantics, run under RE2: services/convert/patterns.py); `targets` match a
module by exact name, `re:` regex, or a vLLM layer class name containing the target (so "Linear"
matches every projection but not lm_head, whose class is ParallelLMHead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.base import Fp4Format, Fp4Weight, Fp8Weight, SourceWeight
from kernels.codecs.compressed_tensors import decode_int_quantized, decode_pack_quantized
from kernels.codecs.fp4 import unpack_fp4
from kernels.errors import UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError
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
from services.convert.formats.gptq import with_explicit_g_idx
from services.convert.patterns import REGEX_PREFIX, NameMatcher, PatternCompiler

PACKED = "pack-quantized"
FLOAT = "float-quantized"
INT = "int-quantized"
NAIVE = "naive-quantized"
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
# Fields of compressed-tensors' QuantizationArgs / QuantizationScheme (both pydantic extra="forbid").
ARGS_FIELDS = frozenset(
    {
        "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
        "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
    }
)  # fmt: skip
SCHEME_FIELDS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    matcher: NameMatcher  # the targets that are module names or `re:` patterns
    weights: dict[str, Any]
    input_activations: dict[str, Any] | None
    format: str


def _strategy(args: dict[str, Any], where: str) -> str:
    if args.get("strategy"):
        return str(args["strategy"])
    if args.get("group_size") is None:
        return "tensor"
    return "channel" if cfg_int(args, "group_size", where) == -1 else "group"


def _forbid_extra(obj: dict[str, Any], allowed: frozenset[str], where: str, model: str) -> None:
    """compressed-tensors' pydantic models are extra="forbid": an unknown key is a malformed config."""
    extra = sorted(str(k) for k in obj if k not in allowed)
    if extra:
        raise QuantConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, extra))} (compressed-tensors {model} "
            f"forbids extra fields; allowed: {', '.join(sorted(allowed))}); fix the config"
        )


def _fp4_format(strategy: str, group_size: object, symmetric: bool) -> Fp4Format | None:
    """vLLM's rules: NVFP4 is tensor_group / 16, MXFP4 is group / 32, both symmetric."""
    if not symmetric:
        return None
    if strategy == "tensor_group" and group_size == 16:
        return "nvfp4"
    if strategy == "group" and group_size == 32:
        return "mxfp4"
    return None


class CompressedTensorsFormat(CheckpointFormat):
    name = "compressed-tensors"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        global_format = str(q.get("format") or "dense")
        sparsity = cfg_dict(q, "sparsity_config", "compressed-tensors")
        if sparsity and str(sparsity.get("format", "dense")) != "dense":
            raise UnsupportedError(
                f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported. "
                f"{SUPPORTED_FORMATS_MESSAGE}"
            )
        if q.get("transform_config"):
            raise UnsupportedError(
                f"compressed-tensors transforms are not supported. {SUPPORTED_FORMATS_MESSAGE}"
            )
        patterns = PatternCompiler("compressed-tensors")
        self.ignore = patterns.names(cfg_list(q, "ignore", "compressed-tensors"), "ignore")
        self.groups: list[_Group] = []
        for gname, g in cfg_dict(q, "config_groups", "compressed-tensors").items():
            where = f"compressed-tensors config_groups.{gname}"
            if not isinstance(g, dict):
                raise QuantConfigError(f"{where} must be an object (a QuantizationScheme), got {g!r}")
            _forbid_extra(g, SCHEME_FIELDS, where, "QuantizationScheme")
            targets = tuple(str(t) for t in cfg_list(g, "targets", where))
            if targets and all(t.endswith("Attention") for t in targets):
                continue  # attention (KV cache) groups: vLLM drops them too
            weights = cfg_dict(g, "weights", where)
            _forbid_extra(weights, ARGS_FIELDS, f"{where}.weights", "QuantizationArgs")
            acts = cfg_dict(g, "input_activations", where) or None
            if acts:
                _forbid_extra(acts, ARGS_FIELDS, f"{where}.input_activations", "QuantizationArgs")
            matcher = patterns.names(targets, f"config_groups.{gname}.targets")
            fmt = str(g.get("format") or global_format)
            self.groups.append(_Group(gname, targets, matcher, weights, acts, fmt))
        self.pattern_count = patterns.count
        if not self.groups:
            raise ConversionError("compressed-tensors config has no config_groups with weight targets")
        self._schemes = {g.name: self._scheme(g) for g in self.groups}

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> CompressedTensorsFormat | None:
        if quantization is None:
            return None
        method = str(quantization.get("quant_method", "")).lower().replace("_", "-")
        return cls(ckpt, quantization) if method == "compressed-tensors" else None

    def _scheme(self, g: _Group) -> LayerQuant:
        w = g.weights
        where = f"compressed-tensors config_groups.{g.name}.weights"
        bits = cfg_int(w, "num_bits", where, 8)
        typ = str(w.get("type", "int"))
        strategy = _strategy(w, where)
        sym = bool(w.get("symmetric", True))
        gs = (
            cfg_int(w, "group_size", where) if w.get("group_size") is not None and strategy == "group" else -1
        )
        if strategy == "group" and gs <= 0:
            raise QuantConfigError(f"{where}: strategy 'group' needs a positive group_size, got {gs}")
        actorder = w.get("actorder")
        act_order = actorder in ("group", "dynamic", True)
        unsupported = UnsupportedError(
            f"compressed-tensors group {g.name!r} (format {g.format}, {typ}{bits}, strategy {strategy}"
            f"{', activations ' + str(g.input_activations.get('type')) if g.input_activations else ''}) "
            f"is not supported. {SUPPORTED_FORMATS_MESSAGE}"
        )
        if typ == "float" and bits == 4:
            fmt = _fp4_format(strategy, gs if strategy == "group" else w.get("group_size"), sym)
            if fmt is None or g.format not in FP4_FORMATS:
                raise unsupported
            return fp4_quant(fmt, fp4_activations=self._fp4_activations(g, fmt))
        if g.format == PACKED:
            if (
                typ != "int"
                or bits not in (4, 8)
                or strategy not in ("group", "channel")
                or g.input_activations
            ):
                raise unsupported
            return LayerQuant("int", bits=bits, group_size=gs, symmetric=sym, act_order=act_order and gs > 0)
        if g.format in (FLOAT, NAIVE) and typ == "float":
            if bits != 8 or strategy not in ("tensor", "channel", "block") or not sym:
                raise unsupported
            raw_block = cfg_list(w, "block_structure", where)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw_block):
                raise QuantConfigError(
                    f"{where}: block_structure must be positive integers, got {raw_block!r}"
                )
            block = tuple(raw_block) or None
            if strategy == "block" and (block is None or len(block) != 2):
                raise unsupported
            return LayerQuant(
                "fp8", bits=8, fp8_strategy=strategy, block_size=block if strategy == "block" else None
            )  # type: ignore[arg-type]
        if g.format in (INT, NAIVE) and typ == "int" and bits == 8:
            if strategy not in ("tensor", "channel", "group"):
                raise unsupported
            return LayerQuant("int", bits=8, group_size=gs, symmetric=sym, int8_activations=self._w8a8(g))
        raise unsupported

    def _fp4_activations(self, g: _Group, fmt: Fp4Format) -> bool:
        """Whether the group declares quantized activations (W4A4 / W4A8): they run 16-bit on every
        target Kiln has (no FP4 math below Blackwell; vLLM runs them through Marlin the same way)."""
        acts = g.input_activations
        if not acts:
            return False
        kind = f"{acts.get('type', 'float')}{acts.get('num_bits', '?')}"
        self.notes.append(
            f"group {g.name}: {fmt} weights with {kind} activations declared; activations run 16-bit "
            "(W4A16) on this target, as vLLM's Marlin FP4 path runs them"
        )
        return True

    def _w8a8(self, g: _Group) -> bool:
        """Whether the group's int8 activations can run as declared: dynamic, per token, symmetric
        int8 (SmoothQuant-style W8A8). Other activation schemes run as W8A16, said in a plan note."""
        acts = g.input_activations
        if not acts:
            return False
        where = f"compressed-tensors config_groups.{g.name}.input_activations"
        kind = (
            f"{acts.get('type', 'int')}{cfg_int(acts, 'num_bits', where, 8)}, "
            f"strategy {_strategy(acts, where)}, {'dynamic' if acts.get('dynamic') else 'static'}, "
            f"{'symmetric' if acts.get('symmetric', True) else 'asymmetric'}"
        )
        usable = kind == "int8, strategy token, dynamic, symmetric"
        if not usable:
            self.notes.append(
                f"group {g.name}: activations ({kind}) run unquantized as W8A16; only dynamic per-token "
                "symmetric int8 activations run as W8A8"
            )
        return usable

    def _group_for(self, module: str, layout: LinearLayout) -> _Group | None:
        for g in self.groups:
            if g.matcher.matches(module):
                return g
        for g in self.groups:
            if any(
                not t.startswith(REGEX_PREFIX) and t.lower() in layout.layer_class.lower() for t in g.targets
            ):
                return g
        return None

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        quantized_tensors = any(self.ckpt.has(f"{module}.{s}") for s in ("weight_packed", "weight_scale"))
        if self.ignore.matches(module):
            if quantized_tensors:
                raise ConversionError(f"{module} is in `ignore` but has quantized tensors")
            return DENSE
        group = self._group_for(module, layout)
        if group is None:
            if quantized_tensors:
                raise ConversionError(
                    f"{module} has quantized tensors but matches no config_groups target"
                    " and is not in `ignore`"
                )
            return DENSE
        return self._schemes[group.name]

    def source_tensors(self, module: str, lq: LayerQuant) -> list[str]:
        if lq.scheme == "dense":
            return super().source_tensors(module, lq)
        if lq.scheme == "fp4":
            scales = ["weight_scale", "weight_global_scale"] if lq.fp4_format == "nvfp4" else ["weight_scale"]
            return self._present(module, lq, ["weight_packed", *scales], [])
        packed = self.ckpt.has(f"{module}.weight_packed")
        main = "weight_packed" if packed else "weight"
        required = [main, "weight_scale"]
        if lq.scheme == "int" and not lq.symmetric:
            required.append("weight_zero_point")
        if lq.act_order:
            required.append("weight_g_idx")
        optional = ["weight_zero_point", "weight_g_idx", "weight_shape"] if packed else ["weight_zero_point"]
        return self._present(module, lq, required, optional)

    def _present(self, module: str, lq: LayerQuant, required: list[str], optional: list[str]) -> list[str]:
        """The layer's tensors: every `required` suffix (else a ConversionError naming the missing
        ones), the `optional` ones the checkpoint has, and its bias."""
        missing = [s for s in required if not self.ckpt.has(f"{module}.{s}")]
        if missing:
            raise ConversionError(
                f"{module}: the checkpoint lacks {', '.join(f'{module}.{s}' for s in missing)} "
                f"required for a compressed-tensors {lq.describe()} layer"
            )
        names = [
            f"{module}.{s}" for s in dict.fromkeys(required + optional) if self.ckpt.has(f"{module}.{s}")
        ]
        if self.ckpt.has(f"{module}.bias"):
            names.append(f"{module}.bias")
        return names

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        if lq.scheme == "fp4":
            assert lq.fp4_format is not None
            divisor = tensors.get(f"{module}.weight_global_scale")
            # compressed-tensors stores NVFP4's global scale as a divisor; Kiln keeps the multiplier
            # vLLM computes from it (1 / divisor in fp32)
            multiplier = None if divisor is None else (1.0 / divisor.float()).reshape(1)
            return Fp4Weight(
                unpack_fp4(tensors[f"{module}.weight_packed"]),
                tensors[f"{module}.weight_scale"],
                lq.fp4_format,
                multiplier,
            )
        if lq.scheme == "fp8":
            weight = tensors[f"{module}.weight"]
            scale = tensors[f"{module}.weight_scale"].float()
            if lq.fp8_strategy == "tensor":
                return Fp8Weight(weight, scale.reshape(1), "tensor")
            if lq.fp8_strategy == "channel":
                return Fp8Weight(weight, scale.reshape(-1), "channel")
            return Fp8Weight(weight, scale, "block", block_size=lq.block_size)
        if f"{module}.weight_packed" in tensors:
            shape = tensors.get(f"{module}.weight_shape")
            w = decode_pack_quantized(
                tensors[f"{module}.weight_packed"],
                tensors[f"{module}.weight_scale"],
                tensors.get(f"{module}.weight_zero_point"),
                tensors.get(f"{module}.weight_g_idx"),
                bits=lq.bits,
                group_size=lq.group_size,
                k=int(shape[1]) if shape is not None else None,
            )
            return with_explicit_g_idx(w, lq)
        weight = tensors[f"{module}.weight"]
        if weight.dtype != torch.int8:
            raise ConversionError(f"{module}.weight is {weight.dtype}; int-quantized layers store int8")
        return decode_int_quantized(
            weight,
            tensors[f"{module}.weight_scale"],
            tensors.get(f"{module}.weight_zero_point"),
            group_size=lq.group_size,
        )
