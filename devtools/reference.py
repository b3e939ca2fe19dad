"""The fp32 transformers reference that runtime logits are compared with: router near-ties marked,
and the converter's online FP8 rounding applied to a bf16 model (tests/runtime/test_moe.py and
bench/gpu_serve.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ROUTER_MODULE_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate", ".mlp.router")  # gpt-oss: router


# DeepSeek-V3 chooses on sigmoid scores (slope at most 1/4): a logit perturbation d moves a score
# by at most d / 4, so a gap g between two scores takes a logit perturbation of 2g to close; a group
# is scored by the sum of two, so a gap between groups takes g.
SIGMOID_EXPERT_GAP_IN_LOGITS = 2.0
SIGMOID_GROUP_GAP_IN_LOGITS = 1.0


def _sigmoid_grouped_gaps(router: Any, logits: torch.Tensor) -> torch.Tensor:
    """(T,) how far DeepSeek-V3's choice is from changing, in router-logit units: the smaller of
    the gap between the last kept and the first dropped group and that between the k-th and the
    (k+1)-th eligible expert (corrected scores)."""
    groups, keep, k = router.num_group, router.topk_group, router.top_k
    choice = torch.sigmoid(logits) + router.e_score_correction_bias.float()
    grouped = choice.unflatten(-1, (groups, -1))
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (T, groups)
    gaps = torch.full((logits.shape[0],), float("inf"))
    if keep < groups:
        top = group_scores.topk(keep + 1, dim=-1).values
        gaps = (top[:, keep - 1] - top[:, keep]) * SIGMOID_GROUP_GAP_IN_LOGITS
    best = group_scores.topk(keep, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
    eligible = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
    if k < keep * grouped.shape[-1]:
        top = eligible.topk(k + 1, dim=-1).values
        gaps = torch.minimum(gaps, (top[:, k - 1] - top[:, k]) * SIGMOID_EXPERT_GAP_IN_LOGITS)
    return gaps


class RoutedReference:
    """A transformers model (fp32, eval) whose MoE routers' logits are recorded on every forward."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.routers: dict[str, torch.Tensor] = {}  # MoE layer -> (T, E) router logits
        self.router_modules: dict[str, Any] = {}
        for name, module in model.named_modules():
            if name.endswith(ROUTER_MODULE_SUFFIXES):
                module.register_forward_hook(self._recorder(name))
                self.router_modules[name] = module

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
        for name, router_logits in self.routers.items():
            router_logits = router_logits.reshape(len(ids), -1)
            module = self.router_modules[name]
            if hasattr(module, "e_score_correction_bias"):
                gaps = torch.minimum(gaps, _sigmoid_grouped_gaps(module, router_logits))
                continue
            top = router_logits.topk(top_k + 1, dim=-1).values
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


def _fake_fp8_fused(linears: list[Any]) -> None:
    """Linears the converter fuses into one layer: one scale over all of them."""
    fq = _fake_fp8(torch.cat([lin.weight for lin in linears]))
    for lin, part in zip(linears, fq.split([lin.weight.shape[0] for lin in linears]), strict=True):
        lin.weight.copy_(part)


def _fake_fp8_mla(attn: Any) -> None:
    """MLA as online FP8 stores it: q_a_proj|kv_a_proj_with_mqa fused (with a q_lora), q_b_proj or
    q_proj, kv_a_proj_with_mqa alone (without), kv_b_proj — one scale each."""
    if getattr(attn, "q_a_proj", None) is not None:
        _fake_fp8_fused([attn.q_a_proj, attn.kv_a_proj_with_mqa])
        attn.q_b_proj.weight.copy_(_fake_fp8(attn.q_b_proj.weight))
    else:
        attn.q_proj.weight.copy_(_fake_fp8(attn.q_proj.weight))
        attn.kv_a_proj_with_mqa.weight.copy_(_fake_fp8(attn.kv_a_proj_with_mqa.weight))
    attn.kv_b_proj.weight.copy_(_fake_fp8(attn.kv_b_proj.weight))


@torch.no_grad()
def fake_quantize_online_fp8(model: Any) -> Any:
    """The bf16 model as the converter's per-tensor online FP8 leaves it: q|k|v and gate|up fused
    under one scale (MLA: `_fake_fp8_mla`), o / down one each, each expert's (and a shared expert's)
    gate|up one scale and its down another; the routers, the shared expert's gate, embeddings, norms
    and lm_head untouched."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "kv_b_proj"):
            _fake_fp8_mla(attn)
        else:
            _fake_fp8_fused([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.o_proj.weight.copy_(_fake_fp8(attn.o_proj.weight))
        block = getattr(layer, "mlp", None) or layer.block_sparse_moe
        experts = getattr(block, "experts", None)
        if experts is None:
            _fake_fp8_mlp(block)
            continue
        # Qwen2-MoE's shared expert (its sigmoid gate stays) or DeepSeek's shared experts
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        if shared is not None:
            _fake_fp8_mlp(shared)
        for e in range(experts.gate_up_proj.shape[0]):
            experts.gate_up_proj[e].copy_(_fake_fp8(experts.gate_up_proj[e]))  # (2I, H)
            experts.down_proj[e].copy_(_fake_fp8(experts.down_proj[e]))  # (H, I)
    return model
