"""Intel AutoRound checkpoints in its own format (quant_method "auto-round"), as auto-round 0.15
writes them and vLLM's AutoRoundConfig reads them.

`packing_format` names the tensor layout: "auto_round:auto_gptq" (symmetric exports) is AutoGPTQ's
(qweight / qzeros / scales, zero points stored minus one, no g_idx), "auto_round:auto_awq"
(asymmetric exports) AutoAWQ-GEMM's; so the layers go through the GPTQ and AWQ readers with
AutoRound's config keys (bits, group_size, sym). Exports written with `format="auto_gptq"` /
`"auto_awq"` carry quant_method "gptq" / "awq" and are those formats already. Other data types
(fp8, mxfp4, nvfp4 AutoRound schemes), other packings and per-layer `extra_config` overrides are
refused with the supported list.
"""

from __future__ import annotations

from typing import Any

from kernels.errors import UnsupportedError
from services.convert.checkpoint import Checkpoint
from services.convert.formats.awq import AwqFormat
from services.convert.formats.base import SUPPORTED_FORMATS_MESSAGE, CheckpointFormat
from services.convert.formats.gptq import GptqFormat

METHODS = ("auto-round", "auto_round", "intel/auto-round")
PACKINGS = ("auto_round:auto_gptq", "auto_round:auto_awq")


class AutoRoundGptq(GptqFormat):
    name = "auto-round"


class AutoRoundAwq(AwqFormat):
    name = "auto-round"


class AutoRoundFormat(CheckpointFormat):
    """Detection only: an AutoRound checkpoint becomes an `AutoRoundGptq` or `AutoRoundAwq`."""

    name = "auto-round"

    @classmethod
    def detect(
        cls, ckpt: Checkpoint, quantization: dict[str, Any] | None, where: str
    ) -> CheckpointFormat | None:
        if quantization is None or str(quantization.get("quant_method", "")).lower() not in METHODS:
            return None
        q = quantization
        packing = str(q.get("packing_format", "auto_round:auto_gptq")).lower()
        data_type = str(q.get("data_type", "int")).lower()
        if packing not in PACKINGS or data_type != "int":
            raise UnsupportedError(
                f"AutoRound packing_format {packing!r} with data_type {data_type!r} is not supported; Kiln "
                f"reads AutoRound's integer {' / '.join(PACKINGS)} packings (or its gptq / awq exports). "
                f"{SUPPORTED_FORMATS_MESSAGE}"
            )
        if q.get("extra_config"):
            raise UnsupportedError(
                "AutoRound extra_config (per-layer bits / group size) is not supported; export the model "
                f"with one scheme. {SUPPORTED_FORMATS_MESSAGE}"
            )
        common = {"bits": q.get("bits"), "group_size": q.get("group_size")}
        fmt: CheckpointFormat
        if packing == "auto_round:auto_gptq":
            fmt = AutoRoundGptq(ckpt, {**common, "sym": q.get("sym", True), "desc_act": False})
        else:
            fmt = AutoRoundAwq(ckpt, {**common, "zero_point": True, "version": "gemm"})
        fmt.quantization = q  # the manifest records the config as the checkpoint has it
        fmt.notes.append(
            f"AutoRound {packing}: read with the {packing.rsplit('_', 1)[-1].upper()} layout rules"
        )
        return fmt

    def layer_quant(self, module: str, layout: Any) -> Any:  # pragma: no cover - detection only
        raise NotImplementedError
