"""gpt-oss in OpenAI's native MXFP4 format, written from the bf16 source of devtools/builders/moe.py.

OpenAI's release stores the experts of each layer stacked, E2M1 codes two per byte (element 2j in the
low nibble) with an E8M0 exponent byte per 32 input features:

    model.layers.L.mlp.experts.gate_up_proj_blocks (E, 2I, H/32, 16) uint8, gate/up rows interleaved
    model.layers.L.mlp.experts.gate_up_proj_scales (E, 2I, H/32) uint8
    model.layers.L.mlp.experts.down_proj_blocks (E, H, I/32, 16), down_proj_scales (E, H, I/32)
    ..._bias as in the bf16 checkpoint; config.json quantization_config {"quant_method": "mxfp4"}

The bf16 source's transformers layout is x @ W (`gate_up_proj` (E, H, 2I)): its transpose is the
row-major weight quantized here, per row blocks of 32 (OCP MX: exponent floor(log2(amax)) - 2, codes
the nearest E2M1 value). The reference dequantizes with transformers' own `convert_moe_packed_tensors`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from devtools.builders import smollm2
from devtools.builders.moe import build_source, load_safetensors
from kernels.codecs.fp4 import pack_fp4, quantize_fp4

PROJECTIONS = ("gate_up_proj", "down_proj")
MODULES_NOT_CONVERTED = [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
]  # fmt: skip


def _mxfp4(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, K, N) x @ W experts -> blocks (E, N, K/32, 16) and scales (E, N, K/32) uint8."""
    blocks, scales = [], []
    for w in stacked.float().transpose(1, 2):  # (N, K) per expert
        codes, exponents, _ = quantize_fp4(w, "mxfp4")
        blocks.append(pack_fp4(codes).reshape(w.shape[0], -1, 16))
        scales.append(exponents)
    return torch.stack(blocks), torch.stack(scales)


def _write(source: Path, out: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, t in load_safetensors(source).items():
        last = name.rsplit(".", 1)[-1]
        if last in PROJECTIONS and ".mlp.experts" in name:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _mxfp4(t)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    skipped = ("config.json", smollm2.COMPLETE_MARKER)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skipped:
            shutil.copy2(f, out / f.name)


def build_gpt_oss_mxfp4(cache: Path | None = None, name: str = "gpt-oss") -> Path:
    """A tiny gpt-oss (moe.SPECS[name]) with its experts in native MXFP4 (once per cache)."""
    source = build_source(name, cache)
    return smollm2._cached_build(f"{source.name}--native-mxfp4-v1", cache, lambda out: _write(source, out))
