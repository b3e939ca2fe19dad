"""Division that rounds the same on every device.

torch divides a CUDA tensor by a Python number (a CPU scalar) as a multiplication by its reciprocal,
which can differ from the correctly rounded quotient by one ulp; the CPU and the Triton kernels
(`tl.div_rn`) round correctly. A per-token activation scale one ulp off moves some quantized values
by one step, so the references divide by a tensor of the divisor instead (IEEE division on both).
"""

from __future__ import annotations

import torch


def exact_div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor, correctly rounded on CPU and CUDA alike."""
    return t / torch.full_like(t, divisor)
