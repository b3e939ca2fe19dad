"""Format detection with vLLM's precedence (docs/formats.md §7), plus pluggable third-party formats.

The quantization config comes from config.json `quantization_config`, else `compression_config`,
else `text_config.quantization_config`; unlike vLLM, a checkpoint holding only quantize_config.json
(AutoGPTQ) or quant_config.json (AutoAWQ) is also detected. Formats registered under the
entry-point group `kiln.formats` (a `CheckpointFormat` subclass) are tried before the built-ins,
as vLLM gives externally registered methods precedence.
"""

from __future__ import annotations

import logging
import re
from importlib.metadata import entry_points
from typing import Any

from kernels.errors import KilnError, UnsupportedError
from kernels.registry import import_object
from services.convert.checkpoint import QUANT_SIDE_CONFIGS, Checkpoint
from services.convert.errors import QuantConfigError
from services.convert.formats.base import SUPPORTED_FORMATS_MESSAGE, CheckpointFormat

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kiln.formats"
# Every built-in format ("module:Class"), in detection order (vLLM's precedence). Adding a format is
# its file in services/convert/formats/ plus one line here.
FORMATS: tuple[str, ...] = (
    "services.convert.formats.gguf:GgufFormat",
    "services.convert.formats.gptq:GptqFormat",
    "services.convert.formats.auto_round:AutoRoundFormat",
    "services.convert.formats.awq:AwqFormat",
    "services.convert.formats.bitsandbytes:BitsAndBytesFormat",
    "services.convert.formats.modelopt:ModelOptFormat",
    "services.convert.formats.fp8:Fp8Format",
    "services.convert.formats.quark:QuarkFormat",
    "services.convert.formats.torchao:TorchAoFormat",
    "services.convert.formats.gpt_oss_mxfp4:GptOssMxfp4Format",
    "services.convert.formats.compressed_tensors:CompressedTensorsFormat",
    "services.convert.formats.dense:DenseFormat",
)


BUILTIN_FORMATS: tuple[type[CheckpointFormat], ...] = tuple(map(import_object, FORMATS))  # type: ignore[arg-type]
KNOWN_UNSUPPORTED = {
    "deepspeedfp": "DeepSpeedFP checkpoints are not supported",
    "hqq": "HQQ checkpoints are not supported",
    "eetq": "EETQ checkpoints are not supported",
    "aqlm": "AQLM checkpoints are not supported",
    "exl2": "EXL2 checkpoints are not supported",
    "marlin": "pre-packed Marlin checkpoints are not supported (vLLM has no loader for them either)",
}


def find_quant_config(ckpt: Checkpoint) -> tuple[dict[str, Any] | None, str]:
    cfg = ckpt.config
    for key in ("quantization_config", "compression_config"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise QuantConfigError(
                f"{ckpt.uri}/config.json: {key} must be an object, "
                f"got {type(cfg[key]).__name__}; fix the config"
            )
        if isinstance(cfg.get(key), dict):
            return cfg[key], f"config.json:{key}"
    text = cfg.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("quantization_config"), dict):
        return text["quantization_config"], "config.json:text_config.quantization_config"
    for name in QUANT_SIDE_CONFIGS:
        if name in ckpt.side_configs:
            return ckpt.side_configs[name], name
    return None, ""


def plugin_formats() -> list[type[CheckpointFormat]]:
    """Formats installed under `kiln.formats` (re-read every call: installing a package needs no restart)."""
    found: list[type[CheckpointFormat]] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if not (isinstance(obj, type) and issubclass(obj, CheckpointFormat)):
            raise KilnError(f"entry point {ep.name} = {ep.value} is not a CheckpointFormat subclass")
        log.info("checkpoint format plugin %s from %s", obj.name, ep.value)
        found.append(obj)
    return found


def detect_format(ckpt: Checkpoint) -> CheckpointFormat:
    quantization, where = find_quant_config(ckpt)
    for cls in [*plugin_formats(), *BUILTIN_FORMATS]:
        try:
            fmt = cls.detect(ckpt, quantization, where.removeprefix("config.json:") if where else where)
        except KilnError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, re.error, RecursionError) as e:
            raise QuantConfigError(
                f"{ckpt.uri}: malformed {cls.name} quantization config in {where} "
                f"({type(e).__name__}: {str(e)[:200]}); fix the config"
            ) from e
        if fmt is not None:
            if where in QUANT_SIDE_CONFIGS:
                fmt.notes.append(f"quantization config read from {where} (config.json has none)")
            return fmt
    method = str((quantization or {}).get("quant_method", "")).lower()
    reason = KNOWN_UNSUPPORTED.get(method, f"quantization method {method or '(none)'!r} is not supported")
    raise UnsupportedError(f"{ckpt.uri}: {reason}. {SUPPORTED_FORMATS_MESSAGE}")
