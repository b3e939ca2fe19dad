"""`@triton.jit` pieces of the FP4 (E2M1) weight kernels (marlin_fp4, tile_fp4): decodes by bit
arithmetic into fp32, for GPUs without FP4 / FP8 conversion instructions.

`e2m1_fp32`: int32 codes 0..15 -> the fp32 E2M1 values (sign bit 3; magnitude 2e + m: 0.5 m at e = 0,
(1 + m / 2) 2^(e - 1) above: fp32 bits (mag + 252) << 22);
`block_scale_fp32`: int32 scale bytes -> fp32: E4M3 (NVFP4) exactly, or E8M0 2^(byte - 127) (MXFP4;
byte 0 is the fp32 subnormal 2^-127).
`fp4_gpu_reason`: the layer checks both kernels share.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kernels.base import FP4_GROUP_SIZE, LinearSpec, Target
from kernels.fp8_tiles import fp8_tiles
from kernels.jit import act_dtype_reason, jit, triton_builder


def fp4_gpu_reason(spec: LinearSpec, kernel: str, target: Target) -> str:
    """Why a GPU FP4 weight-only kernel (marlin_fp4, tile_fp4) cannot take a layer, or "": the act
    dtype on the target, the format and its block, and MXFP4's E8M0 scales, which float16 cannot hold
    (an E8M0 scale times an E2M1 value leaves float16's 2^-24..2^15 for most exponents)."""
    if reason := act_dtype_reason(spec.act_dtype, kernel, target):
        return reason
    fmt = spec.fp4_format
    if fmt is None:
        return "FP4 layer without fp4_format (nvfp4 / mxfp4) in its spec"
    if spec.group_size != FP4_GROUP_SIZE[fmt]:
        return f"{fmt} has a scale per {FP4_GROUP_SIZE[fmt]} inputs, spec says {spec.group_size}"
    if fmt == "mxfp4" and spec.act_dtype == "float16":
        return (
            "MXFP4 with float16 activations: an E8M0 scale in float16 (vLLM's Marlin path casts it) "
            "zeroes or overflows outside 2^-24..2^15; a checkpoint whose config.json dtype is bfloat16 "
            "runs it (the act dtype follows it), or target cpu"
        )
    return ""


@triton_builder
def fp4_tiles(tl: ModuleType) -> tuple[Any, Any]:
    """(e2m1_fp32, block_scale_fp32), see the module docstring."""
    e4m3_to_f32 = fp8_tiles()[0]

    def e2m1_fp32(q):
        mag = q & 7
        bits = tl.where(mag < 2, mag * 0x3F000000, (mag + 252) << 22) | ((q & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    def block_scale_fp32(b, NVFP4: tl.constexpr):
        if NVFP4:
            s = e4m3_to_f32(b)
        else:
            s = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
        return s

    return jit(e2m1_fp32), jit(block_scale_fp32)
