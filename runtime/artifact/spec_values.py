"""The values of a manifest layer's `spec` (kernels.base.LinearSpec / kernels.moe_base.MoESpec, as
JSON): every field of the right type (no coercion: `"4"`, `4.0` and `true` are not 4) and in range,
checked when the manifest is parsed, before any kernel computes a shape from them.

Only types and ranges here; whether the values fit the model (shapes) and the kernel (bits, group
size, strategy) is the loader's check (`runtime.loader`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from runtime.model_layout import MAX_EXPERTS, MAX_SWIGLU_LIMIT

# Far above any layer (the lm_head of a 4M-token vocabulary); the model config bounds them tightly.
MAX_FEATURES = 1 << 24
BITS = (2, 3, 4, 5, 6, 8, 16, 32)  # 5 / 6: GGUF Q5_x / Q6_K codes


def _bits(value: int) -> int:
    if value not in BITS:
        raise ValueError(f"must be one of {', '.join(map(str, BITS))}")
    return value


def _group_size(value: int) -> int:
    if value < -1:
        raise ValueError("must be -1 (channelwise), 0 or a positive group size")
    return value


Features = Annotated[int, Field(strict=True, ge=1, le=MAX_FEATURES)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ShardValues(_Strict):
    name: str
    size: Features


class LinearSpecValues(_Strict):
    name: str
    scheme: Literal["int", "fp8", "fp4", "dense"]
    n: Features
    k: Features
    k_full: Annotated[int, Field(strict=True, ge=0, le=MAX_FEATURES)] = 0
    bits: Annotated[int, Field(strict=True), AfterValidator(_bits)] = 16
    group_size: Annotated[int, Field(strict=True, le=MAX_FEATURES), AfterValidator(_group_size)] = -1
    symmetric: bool = True
    act_order: bool = False
    fp8_strategy: Literal["tensor", "channel", "block"] | None = None
    block_size: Annotated[list[Features], Field(min_length=2, max_length=2)] | None = None
    row_parallel: bool = False
    has_bias: bool = False
    act_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    int8_activations: bool = False
    shards: list[ShardValues] = Field(default_factory=list)
    float_zeros: bool = False
    fp4_format: Literal["nvfp4", "mxfp4"] | None = None
    fp4_activations: bool = False
    group_scale_factor: Annotated[float, Field(ge=0.0, le=2.0**64)] = 0.0
    codebook: Literal["", "nf4", "fp4"] = ""


class MoESpecValues(_Strict):
    name: str
    num_experts: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)]
    top_k: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)]
    w13: LinearSpecValues
    w2: LinearSpecValues
    first_expert: Annotated[int, Field(strict=True, ge=0, le=MAX_EXPERTS)] = 0
    total_experts: Annotated[int, Field(strict=True, ge=0, le=MAX_EXPERTS)] = 0
    activation: Literal["silu", "swigluoai"] = "silu"  # kernels.moe_base.EXPERT_ACTIVATIONS
    swiglu_limit: Annotated[float, Field(ge=0.0, le=MAX_SWIGLU_LIMIT)] = 0.0
    hidden_pad: Annotated[int, Field(strict=True, ge=0, le=MAX_FEATURES)] = 0
    intermediate_pad: Annotated[int, Field(strict=True, ge=0, le=MAX_FEATURES)] = 0


def _checked(model: type[_Strict], value: dict[str, Any]) -> None:
    try:
        model.model_validate(value)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(part) for part in err["loc"])
        got = repr(err.get("input"))[:80] if err["type"] != "missing" else "missing"
        message = str(err["msg"]).removeprefix("Value error, ")
        raise ValueError(f"spec.{field} = {got}: {message}") from None


def check_linear_spec(value: dict[str, Any]) -> None:
    """ValueError naming the first field of a LinearSpec JSON of the wrong type or out of range."""
    _checked(LinearSpecValues, value)


def check_moe_spec(value: dict[str, Any]) -> None:
    """ValueError naming the first field of a MoESpec JSON of the wrong type or out of range."""
    _checked(MoESpecValues, value)
