"""Mixture-of-experts kernels, apart from the linear ones (as vLLM keeps `fused_moe/`).

align.py    route sorting: the (token, choice) slots grouped by expert and padded to BLOCK_M
fused.py    the fused schedule (two grouped GEMM launches per layer), its tiles and `FusedExperts`
stacked.py  `stacked_experts(inner)`: any linear kernel's layout per expert, run expert by expert
marlin.py   marlin_moe_wna16, fused over the Marlin MoE layout
fp8.py      fp8_moe_w8a8 / fp8_moe_w8a16, fused over the FP8 layouts
The contract every expert-group kernel implements is kernels/moe_base.py.
"""
