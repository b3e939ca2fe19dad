"""The fp32 transformers reference that runtime logits are compared with: router near-ties marked,
and the converter's online FP8 rounding applied to a bf16 model (tests/runtime/test_moe.py and
bench/gpu_serve.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ROUTER_MODULE_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate")


class RoutedReference:
    """A transformers model (fp32, eval) whose MoE routers' logits are recorded on every forward."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.routers: dict[str, torch.Tensor] = {}  # MoE layer -> (T, E) router logits
        for name, module in model.named_modules():
            if name.endswith(ROUTER_MODULE_SUFFIXES):
                module.register_forward_hook(self._recorder(name))

    def _recorder(self, name: str) -> Callable[..., None]:
        def record(_module: Any, _inputs: Any, output: Any) -> None:
            self.routers[name] = (output[0] if isinstance(output, tuple) else output).detach().float()

        return record

    @torch.inference_mode()
    def logits_and_gaps(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, V) fp32 logits and (T,) the smallest gap over MoE layers between the k-th and the
        (k+1)-th router logit at each position (inf without MoE layers)."""
        self.routers.clear()
        logits = self.model(torch.tensor([ids])).logits[0].float()
        gaps = torch.full((len(ids),), float("inf"))
        top_k = self.model.config.num_experts_per_tok if self.routers else 0
        for router_logits in self.routers.values():
            top = router_logits.reshape(len(ids), -1).topk(top_k + 1, dim=-1).values
            gaps = torch.minimum(gaps, top[:, top_k - 1] - top[:, top_k])
        return logits, gaps

    def logits(self, ids: list[int], tie_gap: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, V) fp32 logits and (T,) bool: routing decided in every MoE layer at that position
        (its k-th router logit at least `tie_gap` above the next)."""
        logits, gaps = self.logits_and_gaps(ids)
        return logits, gaps >= tie_gap

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The model's own greedy continuation of `prompt` (n tokens, full recompute per step)."""
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits_and_gaps(ids)[0][-1].argmax()))
        return ids[len(prompt) :]


def _fake_fp8(w: torch.Tensor) -> torch.Tensor:
    """One e4m3 scale for the whole tensor (amax / 448), round to e4m3 and back."""
    scale = w.abs().amax().float() / 448.0
    return ((w.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def _fake_fp8_mlp(mlp: Any) -> None:
    """A SwiGLU MLP as online FP8 stores it: gate|up under one scale, down under its own."""
    gate_up = _fake_fp8(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    mlp.gate_proj.weight.copy_(gate_up[: mlp.gate_proj.weight.shape[0]])
    mlp.up_proj.weight.copy_(gate_up[mlp.gate_proj.weight.shape[0] :])
    mlp.down_proj.weight.copy_(_fake_fp8(mlp.down_proj.weight))


@torch.no_grad()
def fake_quantize_online_fp8(model: Any) -> Any:
    """The bf16 model as the converter's per-tensor online FP8 leaves it: q|k|v and gate|up fused
    under one scale, o / down one each, each expert's (and a shared expert's) gate|up one scale and
    its down another; the routers, the shared expert's gate, embeddings, norms and lm_head untouched."""
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        fq = _fake_fp8(qkv)
        sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
        for lin, part in zip((attn.q_proj, attn.k_proj, attn.v_proj), fq.split(sizes), strict=True):
            lin.weight.copy_(part)
        attn.o_proj.weight.copy_(_fake_fp8(attn.o_proj.weight))
        block = getattr(layer, "mlp", None) or layer.block_sparse_moe
        experts = getattr(block, "experts", None)
        if experts is None:
            _fake_fp8_mlp(block)
            continue
        if getattr(block, "shared_expert", None) is not None:  # Qwen2-MoE (its sigmoid gate stays)
            _fake_fp8_mlp(block.shared_expert)
        for e in range(experts.gate_up_proj.shape[0]):
            experts.gate_up_proj[e].copy_(_fake_fp8(experts.gate_up_proj[e]))  # (2I, H)
            experts.down_proj[e].copy_(_fake_fp8(experts.down_proj[e]))  # (H, I)
    return model
