"""tile_lut4: bitsandbytes NF4 / FP4 weight-only GEMV / GEMM (Triton), every GPU target.

The codes index a 16-entry value table (the checkpoint's `quant_map`) and each block of 64 has an
fp32 absmax: w = codebook[q] * absmax. No integer layout holds such non-uniform levels, so the layer
keeps its codes and table: `tile_wna16`'s row-contiguous layout and kernel (its CODEBOOK offset mode:
the table gathered per code, the absmax applied per group; the tensor-core path rounds the
dequantized weight once to the act dtype, as bitsandbytes' own matmul does). Stored tensors:
tile_wna16's, with `codebook (16,) fp32` and the scales (absmax) in fp32. vLLM has no kernel for
these bytes; it is chosen on every GPU conversion (there is no vLLM-identical layout to prefer).
"""

from __future__ import annotations

from typing import ClassVar

from kernels.base import LinearSpec, Target
from kernels.tile_wna16 import TileWNA16Kernel


class TileLut4Kernel(TileWNA16Kernel):
    name: ClassVar[str] = "tile_lut4"
    kiln_layout: ClassVar[bool] = False
    takes_codebook: ClassVar[bool] = True
    takes_float_zeros: ClassVar[bool] = False
    elsewhere: ClassVar[str] = "the cpu target uses cpu_lut4"
    description: ClassVar[str] = "NF4 / FP4 value-table weight-only (bitsandbytes), Triton GEMV / GEMM"

    def supports(self, spec: LinearSpec, target: Target) -> tuple[bool, str]:
        if not spec.codebook or spec.bits != 4:
            return False, "tile_lut4 takes 4-bit value-table (bitsandbytes NF4 / FP4) layers only"
        return super().supports(spec, target)
