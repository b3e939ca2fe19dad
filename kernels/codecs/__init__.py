"""Source-format codecs: checkpoint tensors (GPTQ, AWQ, compressed-tensors, FP8, GGUF) <-> canonical weights.

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
from kernels.codecs.gguf import (
    GGML_TYPES,
    UnsupportedGgufType,
    decode_gguf_int,
    dequantize_gguf,
    encode_gguf_int,
    ggml_type_name,
    permute_qk_rows,
    unpermute_qk_rows,
)
from kernels.codecs.gptq import decode_gptq, encode_gptq, qzeros_look_v2_symmetric

__all__ = [
    "E4M3_MAX",
    "GGML_TYPES",
    "UnsupportedGgufType",
    "awq_to_standard",
    "decode_awq",
    "decode_gguf_int",
    "decode_gptq",
    "decode_int_quantized",
    "decode_pack_quantized",
    "dequantize_gguf",
    "encode_awq",
    "encode_gguf_int",
    "encode_gptq",
    "encode_pack_quantized",
    "ggml_type_name",
    "pack_cols",
    "pack_rows",
    "permute_qk_rows",
    "quantize_fp8",
    "qzeros_look_v2_symmetric",
    "requantize_to_max_scale",
    "round_to_e4m3_grid",
    "unpack_cols",
    "unpack_rows",
    "unpermute_qk_rows",
]
