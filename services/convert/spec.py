"""A conversion request, in one shape (`ConversionSpec`): `kiln convert` / `kiln plan` build it, the
REST body of `POST /v1/conversions` and `POST /v1/plans` is it (services/api/schemas.py adds only the
API's checks on `source`), a job row stores it as JSON (services/db/repo.spec_columns), and the
worker validates the row back into it. The allowed values and the disabled-kernel rule are declared
here once. No torch: the API process imports it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    Strict,
    StringConstraints,
    ValidationError,
    model_serializer,
)

from kernels.errors import UnsupportedError
from kernels.targets import Target
from services.convert.choices import Fp8Scheme, GpuLayout, HeadQuant, Method

MAX_TARGETS = 6
MAX_TP = 64
MAX_DISABLED_KERNELS = 32
MAX_SOURCE_CHARS = 2048

TargetName = Annotated[Target, Strict(False)]  # "sm80" in JSON, also under a strict model
KernelName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,64}$")]


def _json_integer(value: object) -> object:
    """JSON Schema's `integer` includes 7.0; booleans and strings stay refused (strict mode)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_json_integer)]


def disabled_kernels(requested: Iterable[str], configured: Iterable[str]) -> tuple[str, ...]:
    """The kernels a conversion leaves out: the request's and the deployment's (KILN_DISABLED_KERNELS)
    together, so a plan promises only kernels the worker will use."""
    return tuple(dict.fromkeys([*requested, *configured]))


class ConversionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fp8_scheme: Fp8Scheme = "tensor"
    disabled_kernels: list[KernelName] = Field(default_factory=list, max_length=MAX_DISABLED_KERNELS)
    expert_parallel: bool = Field(
        default=False,
        description="Mixture-of-experts models: place whole experts on each of the `tp` ranks "
        "(expert parallel, `kiln convert --ep`) instead of splitting every expert",
    )
    quantize_head: HeadQuant | None = Field(
        default=None,
        description="Quantize lm_head (a tied one from the embedding) online for the `cpu` target: "
        "`int8` is symmetric channelwise: half the bytes of a 16-bit head, which is about half of what a "
        "decode step reads for SmolLM2-sized models; `none` keeps it as stored. Unset: `int8` for a "
        "checkpoint with 4-bit layers converted for `cpu`, else as stored",
    )
    int8_activations: bool | None = Field(
        default=None,
        description="The `cpu` target's 4-bit layers multiply int8 activations (quantized per token and "
        "weight group) with integer dot products (kernel cpu_w4a8, `kiln convert --int8-activations`), "
        "symmetric channelwise 8-bit ones per token (cpu_w8a8): a faster decode for a small perplexity "
        "cost; false keeps 16-bit activations. Unset: the 4-bit layers of a `cpu` conversion take them",
    )

    gpu_layout: GpuLayout | None = Field(
        default=None,
        description="GPU targets: `marlin` stores the layouts vLLM's kernels read as they are (kiln serve "
        "and vLLM's plugin both serve them); `kiln` stores Kiln's own layouts where one takes the layer "
        "(tile_wna16 for int weight-only layers, tile_fp4 for NVFP4 / MXFP4: kiln serve's decode kernels; "
        "vLLM's plugin runs them with Kiln's Triton kernels). Unset: marlin",
    )

    @model_serializer(mode="wrap")
    def _without_unset_options(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Job rows and request digests of conversions that leave --quantize-head / --int8-activations
        to the target's default stay as they were."""
        data: dict[str, Any] = handler(self)
        for name in ("quantize_head", "int8_activations", "gpu_layout"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ConversionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        description="Checkpoint location: s3://bucket/prefix, or an absolute directory on the server "
        "(allowed outside production unless KILN_ALLOW_LOCAL_SOURCES=false)",
        examples=["s3://checkpoints/SmolLM2-135M-Instruct"],
    )
    targets: list[TargetName] = Field(min_length=1, max_length=MAX_TARGETS, examples=[["cpu", "sm80"]])
    method: Method = "auto"
    tp: JsonInt = Field(default=1, ge=1, le=MAX_TP)
    options: ConversionOptions = Field(default_factory=ConversionOptions)

    def row(self) -> dict[str, object]:
        """The fields as a job row stores them (JSON values; targets sorted and distinct)."""
        data = self.model_dump(mode="json")
        data["targets"] = sorted(set(data["targets"]))
        return data


class ConversionSpecError(UnsupportedError):
    """A conversion request with a value outside what it allows (the message names the field)."""


def conversion_spec(**fields: object) -> ConversionSpec:
    """A `ConversionSpec`, or a ConversionSpecError naming every field out of range (the library's and
    the CLI's callers get a KilnError, not pydantic's)."""
    try:
        return ConversionSpec.model_validate(fields)
    except ValidationError as e:
        raise ConversionSpecError("; ".join(_problem(err) for err in e.errors())) from None


def _problem(err: Any) -> str:
    """`method 'int3' is not supported: Input should be 'auto' or 'fp8'`."""
    where = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    shown = f" {value!r}" if isinstance(value, str | int | float) else ""
    return f"{where}{shown} is not supported: {err['msg']}"
