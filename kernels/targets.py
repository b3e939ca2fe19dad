"""Where an artifact runs: the targets, parsed once at the edges (CLI, REST schema, library entry).

Torch-free, so that command-line help and request schemas can list the targets cheaply.
"""

from __future__ import annotations

from enum import StrEnum

from kernels.errors import UnsupportedError


class Target(StrEnum):
    """Where an artifact runs. GPU targets are CUDA compute capabilities."""

    SM75 = "sm75"
    SM80 = "sm80"
    SM86 = "sm86"
    SM89 = "sm89"
    SM90 = "sm90"
    CPU = "cpu"

    @classmethod
    def parse(cls, value: str) -> Target:
        """`value` ("sm80", " CPU ") as a Target; an unknown name is an UnsupportedError listing them."""
        try:
            return cls(value.strip().lower())
        except ValueError as e:
            raise UnsupportedError(f"unknown target {value!r}; use one of {TARGET_NAMES}") from e

    @property
    def is_gpu(self) -> bool:
        return self is not Target.CPU

    @property
    def capability(self) -> int:
        """Compute capability as an int (75, 80, ...); 0 for cpu."""
        return 0 if self is Target.CPU else int(self.value[2:])

    @property
    def has_fp8_tensor_cores(self) -> bool:
        return self.capability >= 89

    @property
    def has_bf16(self) -> bool:
        """bf16 activations run natively: every GPU from sm80 (sm75 has fp16 tensor cores only), and
        the cpu target (torch runs bf16 everywhere; fast where the CPU has bf16 dot products)."""
        return self is Target.CPU or self.capability >= 80


TARGET_NAMES = ", ".join(t.value for t in Target)  # for help texts and error messages
GPU_TARGETS = frozenset(t for t in Target if t.is_gpu)


def gpu_targets(min_capability: int) -> frozenset[Target]:
    """GPU targets of at least this compute capability (75, 80, 89, ...)."""
    return frozenset(t for t in GPU_TARGETS if t.capability >= min_capability)
