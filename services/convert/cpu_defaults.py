"""What a `cpu` conversion does where the request leaves `--quantize-head` / `--int8-activations`
open: for a checkpoint with 4-bit linear layers, the decode path llama.cpp takes on the same weights
(an 8-bit head, int8 activations into the 4-bit layers), because a CPU decode step is bound by the
bytes it reads and the instructions it spends per weight.

Measured on SmolLM2-135M-Instruct GPTQ g64 (2026-12-07, AMD EPYC, 2 cores; docs/formats.md §14.2):
the tied 16-bit head is 56 MB of the ≈ 110 MB a token reads, and cpu_int4 widens every code to
fp32 where cpu_w4a8 multiplies it as it lies (`vpmaddubsw` on AVX2, `vpdpbusd` with VNNI).
Perplexity on the fixed text against the same checkpoint weight-only with its 16-bit head: int8 head
+0.07 % (fp32 activations, AVX2 bodies) / −0.01 % (bf16, AVX-512); with int8 activations too
+0.40 % / −0.43 %. Checkpoints without 4-bit layers (16-bit, FP8, 8-bit) convert as before.

`--quantize-head none` and `--no-int8-activations` keep the 16-bit head and activations (the vLLM
plugin serves only a 16-bit head); GPU targets never take either by default.
"""

from __future__ import annotations

from kernels.errors import UnsupportedError
from kernels.targets import Target
from runtime.model_layout import LinearLayout, ModelConfig, linear_layouts
from services.convert.checkpoint import Checkpoint
from services.convert.choices import NO_HEAD_QUANT
from services.convert.formats.base import DENSE, CheckpointFormat

HEAD_DEFAULT = "int8"  # the head a cpu conversion of a 4-bit checkpoint gets
# weight bits whose layers take int8 activations: by default (4-bit layers, cpu_w4a8) and with
# --int8-activations (also symmetric channelwise 8-bit layers, cpu_w8a8)
DEFAULT_INT8_ACTIVATION_BITS: tuple[int, ...] = (4,)
REQUESTED_INT8_ACTIVATION_BITS: tuple[int, ...] = (4, 8)


def head_quant(requested: str | None, target: Target, has_4bit_layers: bool) -> str | None:
    """The head quantization a conversion applies: the request's, else the target's default (None:
    lm_head as the checkpoint stores it)."""
    if requested == NO_HEAD_QUANT:
        return None
    if requested is not None:
        return requested
    return HEAD_DEFAULT if target is Target.CPU and has_4bit_layers else None


def int8_activation_bits(requested: bool | None, target: Target, has_4bit_layers: bool) -> tuple[int, ...]:
    """The weight bits whose layers multiply int8 activations: none, the default's or the request's."""
    if requested is None:
        return DEFAULT_INT8_ACTIVATION_BITS if target is Target.CPU and has_4bit_layers else ()
    if requested and target is not Target.CPU:
        raise UnsupportedError(
            f"--int8-activations is for the cpu target (its cpu_w4a8 kernel); {target.value} keeps the "
            "checkpoint's activations: convert GPU targets without it"
        )
    return REQUESTED_INT8_ACTIVATION_BITS if requested else ()


def options_entry(bits: tuple[int, ...]) -> bool | str | None:
    """How an artifact's options record the int8 activations (None: not recorded, as before)."""
    if bits == REQUESTED_INT8_ACTIVATION_BITS:
        return True
    return "4-bit" if bits else None


def has_4bit_layers(fmt: CheckpointFormat, model: ModelConfig) -> bool:
    """Some decoder linear layer is stored as 4-bit integers (what the cpu defaults key on)."""
    for layout in linear_layouts(model, has_lm_head=False):
        for shard in layout.shards:
            quant = fmt.layer_quant(shard.module, layout)
            if quant.scheme == "int" and quant.bits == 4:
                return True
    return False


def head_not_16_bit(
    ckpt: Checkpoint, fmt: CheckpointFormat, head: LinearLayout, has_lm_head: bool
) -> str | None:
    """How the head's source (lm_head, or the tied embedding) is stored when not 16- or 32-bit: an
    online quantization needs a float one."""
    (shard,) = head.shards
    stored = fmt.layer_quant(shard.module, head) if has_lm_head else DENSE
    info = ckpt.tensors.get(f"{shard.module}.weight")
    if stored.scheme != "dense" or info is None or info.dtype not in ("BF16", "F16", "F32"):
        return stored.describe() if stored.scheme != "dense" else (info.dtype if info else "missing")
    return None


def head_is_16_bit(ckpt: Checkpoint, fmt: CheckpointFormat, model: ModelConfig, has_lm_head: bool) -> bool:
    """lm_head (or the tied embedding it would be read from) is stored 16- or 32-bit."""
    if not has_lm_head and not model.tie_word_embeddings:
        return False
    head = linear_layouts(model, has_lm_head, tied_head=True)[-1]
    return head_not_16_bit(ckpt, fmt, head, has_lm_head) is None
