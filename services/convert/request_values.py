"""What a conversion request may ask for, declared once: the CLI, the REST schema, the library and the
planner read the allowed values and the disabled-kernel rule from here. No torch: the API process
imports it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

Method = Literal["auto", "fp8"]  # keep the checkpoint's quantization | quantize to FP8 online
Fp8Scheme = Literal["tensor", "channel", "block"]  # online FP8 scales
METHODS: tuple[str, ...] = get_args(Method)
FP8_SCHEMES: tuple[str, ...] = get_args(Fp8Scheme)


def disabled_kernels(requested: Iterable[str], configured: Iterable[str]) -> tuple[str, ...]:
    """The kernels a conversion leaves out: the request's and the deployment's (KILN_DISABLED_KERNELS)
    together, so a plan promises only kernels the worker will use."""
    return tuple(dict.fromkeys([*requested, *configured]))
