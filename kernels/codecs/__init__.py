"""Source-format codecs: checkpoint tensors (GPTQ, AWQ, compressed-tensors, FP8) <-> canonical weights.

Pure torch on CPU, vectorized; layouts as in docs/formats.md §1-§5.
"""

from kernels.codecs.awq import awq_to_standard, decode_awq, encode_awq
from kernels.codecs.bitpack import pack_cols, pack_rows, unpack_cols, unpack_rows
from kernels.codecs.compressed_tensors import (
    decode_int_quantized,
    decode_pack_quantized,
    encode_pack_quantized,
)
from kernels.codecs.fp8 import E4M3_MAX, quantize_fp8, requantize_to_max_scale, round_to_e4m3_grid
from kernels.codecs.gptq import decode_gptq, encode_gptq, qzeros_look_v2_symmetric

__all__ = [
    "E4M3_MAX",
    "awq_to_standard",
    "decode_awq",
    "decode_gptq",
    "decode_int_quantized",
    "decode_pack_quantized",
    "encode_awq",
    "encode_gptq",
    "encode_pack_quantized",
    "pack_cols",
    "pack_rows",
    "quantize_fp8",
    "qzeros_look_v2_symmetric",
    "requantize_to_max_scale",
    "round_to_e4m3_grid",
    "unpack_cols",
    "unpack_rows",
]
