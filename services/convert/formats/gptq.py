"""GPTQ checkpoints (AutoGPTQ / GPTQModel; docs/formats.md §1, vLLM's GPTQConfig rules).

Config keys: bits, group_size, desc_act, sym (default true), checkpoint_format|format ("gptq" = v1
zeros stored minus one, "gptq_v2"), lm_head, dynamic (GPTQModel per-module overrides: `-:` rules
leave a module unquantized, `+:`/plain rules override bits/group_size/desc_act/sym; the first rule
whose pattern matches the start of the runtime — possibly fused — name wins, as vLLM's re.match;
patterns run under RE2, services/convert/patterns.py), modules_in_block_to_quantize (substring
match; when absent, a module counts as quantized when it has a `qweight`).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.base import IntWeight, SourceWeight
from kernels.codecs.gptq import decode_gptq, qzeros_look_v2_symmetric
from kernels.errors import LayoutError, UnsupportedError
from runtime.model_layout import LinearLayout
from services.convert.checkpoint import Checkpoint
from services.convert.errors import ConversionError, QuantConfigError, TensorLayoutError
from services.convert.formats.base import (
    DENSE,
    SUPPORTED_FORMATS_MESSAGE,
    CheckpointFormat,
    LayerQuant,
    cfg_int,
    cfg_list,
)
from services.convert.limits import MAX_CONFIG_ENTRIES
from services.convert.patterns import PatternCompiler

SUPPORTED_BITS = (2, 3, 4, 8)
OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")


def _flatten(v: Any) -> list[str]:
    out: list[str] = []
    for item in v or []:
        out.extend(_flatten(item) if isinstance(item, list) else [str(item)])
    return out


class GptqFormat(CheckpointFormat):
    name = "gptq"

    def __init__(self, ckpt: Checkpoint, quantization: dict[str, Any]) -> None:
        super().__init__(ckpt, quantization)
        q = quantization
        self.bits = cfg_int(q, "bits", "GPTQ")
        self.group_size = cfg_int(q, "group_size", "GPTQ")
        if self.group_size == 0 or self.group_size < -1:
            raise QuantConfigError(
                f"GPTQ group_size must be -1 (channelwise) or positive, got {self.group_size}"
            )
        self.desc_act = bool(q.get("desc_act", False))
        self.sym = bool(q.get("sym", True))
        fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
        if q.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedError(
                f"GPTQ checkpoint_format {fmt!r} (pre-packed kernel layout) is not supported; "
                f"re-export as 'gptq' or 'gptq_v2'. {SUPPORTED_FORMATS_MESSAGE}"
            )
        self.v2 = fmt == "gptq_v2"
        self.lm_head = bool(q.get("lm_head", False))
        dynamic = q.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            raise QuantConfigError("GPTQ 'dynamic' must be an object of regex -> overrides")
        # Per rule in the config's order: its overrides, None for a `-:` rule (leave unquantized).
        self.dynamic: list[dict[str, Any] | None] = []
        patterns: list[tuple[str, str]] = []
        for key, overrides in dynamic.items():
            if overrides is not None and not isinstance(overrides, dict):
                raise QuantConfigError(
                    f"GPTQ dynamic rule {key!r} must map to an object of overrides, got {overrides!r}"
                )
            negative = key.startswith("-:")
            patterns.append((key[2:] if negative else key.removeprefix("+:"), f"dynamic rule {key!r}"))
            self.dynamic.append(None if negative else overrides or {})
        compiler = PatternCompiler("GPTQ")
        self.dynamic_rules = compiler.first_of(patterns, "dynamic")
        self.pattern_count = compiler.count
        self.in_block = _flatten(cfg_list(q, "modules_in_block_to_quantize", "GPTQ")) or None
        if self.in_block is not None and len(self.in_block) > MAX_CONFIG_ENTRIES:
            raise QuantConfigError(
                f"GPTQ modules_in_block_to_quantize: {len(self.in_block)} entries, over Kiln's cap of "
                f"{MAX_CONFIG_ENTRIES} (services/convert/limits.py)"
            )
        self._check_bits(self.bits, "quantization config")
        if not self.v2:
            self._detect_mislabeled_v2()

    @classmethod
    def detect(cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str) -> GptqFormat | None:
        if quantization is None:
            return None
        method = str(quantization.get("quant_method", "")).lower()
        legacy = (
            not method
            and where == "quantize_config.json"
            and "bits" in quantization
            and "group_size" in quantization
        )
        return cls(ckpt, quantization) if method == "gptq" or legacy else None

    def _check_bits(self, bits: int, where: str) -> None:
        if bits not in SUPPORTED_BITS:
            raise UnsupportedError(
                f"GPTQ with {bits} bits ({where}) is not supported. {SUPPORTED_FORMATS_MESSAGE}"
            )

    def _detect_mislabeled_v2(self) -> None:
        modules = sorted(self.ckpt.modules_with("qzeros"))
        if not modules:
            return
        module = modules[0]
        qzeros = self.ckpt.read_one(f"{module}.qzeros")
        n = self.ckpt.info(f"{module}.scales").shape[1] if self.ckpt.has(f"{module}.scales") else None
        try:
            looks_v2 = qzeros_look_v2_symmetric(qzeros, self.bits, n=n)
        except (LayoutError, RuntimeError, ValueError) as e:  # torch's reshape errors on odd widths
            raise TensorLayoutError(
                f"gptq layer {module}: {module}.qzeros {tuple(qzeros.shape)} do not fit the config's "
                f"bits={self.bits} ({e}); fix bits in the quantization config or re-export the checkpoint"
            ) from e
        if looks_v2:
            self.v2 = True
            self.notes.append(
                f"checkpoint_format says 'gptq' (v1) but {module}.qzeros hold "
                f"{1 << (self.bits - 1)} in every field (the v2 symmetric value, 0x88888888 for 4-bit): "
                "treating the checkpoint as gptq_v2"
            )

    def _dynamic(self, runtime_name: str) -> dict[str, Any] | bool | None:
        """False: a negative rule matched; a dict: overrides; None: no rule matched."""
        rule = self.dynamic_rules.first(runtime_name)
        if rule is None:
            return None
        overrides = self.dynamic[rule]
        return False if overrides is None else overrides

    def layer_quant(self, module: str, layout: LinearLayout) -> LayerQuant:
        has_q = self.ckpt.has(f"{module}.qweight")
        if module == "lm_head":
            quantized = self.lm_head and has_q
        elif self.in_block is not None:
            quantized = any(m in module for m in self.in_block)
        else:
            quantized = has_q
        bits, group_size, desc_act, sym = self.bits, self.group_size, self.desc_act, self.sym
        rule = self._dynamic(layout.name) if quantized else None
        if rule is False:
            quantized = False
        elif isinstance(rule, dict):
            where = f"GPTQ dynamic override for {layout.name}"
            bits = cfg_int(rule, "bits", where, bits)
            group_size = cfg_int(rule, "group_size", where, group_size)
            desc_act = bool(rule.get("desc_act", desc_act))
            sym = bool(rule.get("sym", sym))
            self._check_bits(bits, f"dynamic override for {layout.name}")
        if not quantized:
            if has_q:
                raise ConversionError(
                    f"{module} has GPTQ tensors but the quantization config leaves it unquantized "
                    "(lm_head / dynamic / modules_in_block_to_quantize); fix the config"
                )
            return DENSE
        if not has_q:
            raise ConversionError(f"{module} should be GPTQ-quantized but has no {module}.qweight")
        if group_size == -1:
            desc_act = False
        return LayerQuant("int", bits=bits, group_size=group_size, symmetric=sym, act_order=desc_act)

    def weight_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        if lq.scheme == "dense":
            return ("weight",)
        return ("qweight", "qzeros", "scales", "g_idx")

    def required_suffixes(self, lq: LayerQuant) -> tuple[str, ...]:
        if lq.scheme == "dense":
            return ("weight",)
        return ("qweight", "qzeros", "scales", *(("g_idx",) if lq.act_order else ()))

    def decode_quantized(self, module: str, lq: LayerQuant, tensors: dict[str, torch.Tensor]) -> SourceWeight:
        w = decode_gptq(
            tensors[f"{module}.qweight"],
            tensors[f"{module}.qzeros"],
            tensors[f"{module}.scales"],
            tensors.get(f"{module}.g_idx") if lq.act_order else None,
            bits=lq.bits,
            group_size=lq.group_size,
            sym=lq.symmetric,
            v2=self.v2,
        )
        return with_explicit_g_idx(w, lq)

    def describe(self) -> str:
        return f"gptq ({'v2' if self.v2 else 'v1'} zeros)"


def with_explicit_g_idx(w: IntWeight, lq: LayerQuant) -> IntWeight:
    """Act-order layers always carry a g_idx (codecs drop a trivial one), so kernels see act_order data."""
    if lq.act_order and w.g_idx is None:
        k = w.codes.shape[1]
        w.g_idx = (torch.arange(k, dtype=torch.int32) // lq.group_size).to(torch.int32)
    return w
