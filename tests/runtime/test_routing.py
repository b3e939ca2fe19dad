"""The runtime's routing (`runtime.model.route`) against transformers' own DeepSeek routers on the same
router weights and hidden states: V3's corrected group-limited sigmoid choice (and Kimi K2's single
group), V2's softmax greedy and group-limited greedy choices."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime.model import route
from runtime.model_layout import ModelConfig

HIDDEN, EXPERTS, TOKENS = 64, 16, 200

# name -> (transformers model_type, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v3-noaux-tc": ("deepseek_v3", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
    "v3-one-group (Kimi K2)": (
        "deepseek_v3",
        {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827},
    ),
    "v3-no-renormalise": ("deepseek_v3", {"n_group": 4, "topk_group": 3, "norm_topk_prob": False}),
    "v2-greedy": ("deepseek_v2", {"topk_method": "greedy", "routed_scaling_factor": 16.0}),
    "v2-group-limited": (
        "deepseek_v2",
        {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
    ),
}


def _router(model_type: str, overrides: dict[str, Any]) -> tuple[Any, ModelConfig]:
    from transformers import AutoConfig
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    config = AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32, intermediate_size=64, vocab_size=64,
        **overrides,
    )  # fmt: skip
    config.architectures = [
        {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}[model_type]
    ]
    router = (v3.DeepseekV3TopkRouter if model_type == "deepseek_v3" else v2.DeepseekV2TopkRouter)(config)
    gen = torch.Generator().manual_seed(len(overrides))
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.2)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.05)
    return router, ModelConfig.from_hf(config.to_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_route_chooses_and_weighs_experts_as_transformers(name: str) -> None:
    router, cfg = _router(*CASES[name])
    assert cfg.moe is not None
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
        bias = getattr(router, "e_score_correction_bias", None)
        weights, ids = route(logits.float(), cfg.moe.routing, cfg.moe.top_k, cfg.moe.renormalize, bias)
    want = torch.zeros(TOKENS, EXPERTS).scatter_(1, want_ids.long(), want_weights.float())
    got = torch.zeros(TOKENS, EXPERTS).scatter_(1, ids, weights)
    assert torch.equal(got != 0, want != 0), "different experts chosen"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
