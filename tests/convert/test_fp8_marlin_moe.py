"""FP8 expert groups converted for sm80 against vLLM 0.32's own Marlin FP8 MoE preparation.

On sm80/sm86 vLLM runs every FP8 MoE layer on Marlin: `prepare_fp8_moe_layer_for_marlin` repacks each
expert's e4m3 bytes and permutes its scales (per-channel, or block scales widened to Marlin groups).
Kiln's sm80 artifact stores the group for `fp8_marlin_moe`, whose layout is fp8_marlin's per expert.
Here llm-compressor's real FP8_DYNAMIC (per-channel) and FP8_BLOCK (128 x 128) checkpoints of the tiny
Qwen3-MoE and DeepSeek-V3 are converted for sm80 and every expert group's bytes compared with vLLM's
function run in its venv on the same checkpoint tensors, stacked as vLLM's MoE loader stacks them
(`gptq_marlin_repack` is CUDA-only: vLLM's pure-Python test helper stands in, as in
tests/kernels/test_marlin_fp4.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from runtime.artifact.manifest import Manifest
from services.convert.library import ConversionRequest, convert
from tests.vllm_plugin.vllm_host import MARLIN_REPACK_PRELUDE, run_in_vllm, split_by_source, vllm_python

VLLM_SCRIPT = (
    MARLIN_REPACK_PRELUDE
    + r"""
from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8 as fp8
out = {}
for name, c in torch.load(sys.argv[1], weights_only=True).items():
    e, two_i, h = c["w13"].shape
    layer = types.SimpleNamespace(
        num_experts=e, hidden_size=h, intermediate_size_per_partition=two_i // 2, orig_dtype=torch.bfloat16,
    )
    if c["block"] is not None:
        layer.weight_block_size = c["block"]
    w13, w2, s13, s2 = fp8.prepare_fp8_moe_layer_for_marlin(layer, c["w13"], c["w2"], c["s13"], c["s2"])
    out[name] = {"w13.qweight": w13, "w2.qweight": w2, "w13.scales": s13, "w2.scales": s2}
torch.save(out, sys.argv[2])
"""
)
# source fixture -> (its expert groups, block size or None for per-channel scales)
SOURCES: dict[str, tuple[tuple[str, ...], list[int] | None]] = {
    "qwen3_moe_fp8_dynamic": (("model.layers.0.mlp.experts", "model.layers.2.mlp.experts"), None),
    "qwen3_moe_fp8_block": (("model.layers.0.mlp.experts", "model.layers.2.mlp.experts"), [128, 128]),
    "deepseek_v3_fp8_block": (("model.layers.1.mlp.experts", "model.layers.2.mlp.experts"), [128, 128]),
}


def _tensors(source: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def _vllm_inputs(tensors: dict[str, torch.Tensor], group: str, block: list[int] | None) -> dict[str, Any]:
    """One group as vLLM's MoE loader holds it: (E, 2I, H) gate|up and (E, H, I) down e4m3 weights,
    their scales stacked the same way (per-channel (E, N, 1), block (E, N / bn, K / bk))."""
    experts = sorted({int(n[len(group) + 1 :].split(".")[0]) for n in tensors if n.startswith(group + ".")})

    def part(e: int, proj: str, suffix: str) -> torch.Tensor:
        return tensors[f"{group}.{e}.{proj}.{suffix}"]

    def stacked(projs: tuple[str, ...], suffix: str) -> torch.Tensor:
        return torch.stack([torch.cat([part(e, p, suffix) for p in projs]) for e in experts])

    scale = "weight_scale"
    return {
        "w13": stacked(("gate_proj", "up_proj"), "weight"),
        "w2": stacked(("down_proj",), "weight"),
        "s13": stacked(("gate_proj", "up_proj"), scale).float(),
        "s2": stacked(("down_proj",), scale).float(),
        "block": block,
    }


@pytest.fixture(scope="module")
def sm80_and_vllm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]:
    """Per source: (its sm80 artifact, vLLM's prepared tensors of every expert group), one vLLM run."""
    vllm_python()  # skips without the venv, before any conversion
    work = tmp_path_factory.mktemp("fp8_marlin_moe")
    cases: dict[str, Any] = {}
    artifacts: dict[str, Path] = {}
    for fixture, (groups, block) in SOURCES.items():
        source: Path = request.getfixturevalue(fixture)
        (result,) = convert(ConversionRequest(str(source), ["sm80"], out=str(work / fixture)))
        artifacts[fixture] = work / fixture / result.manifest.artifact_id
        tensors = _tensors(source)
        for group in groups:
            cases[f"{fixture}:{group}"] = _vllm_inputs(tensors, group, block)
    theirs = split_by_source(run_in_vllm(VLLM_SCRIPT, cases, work), list(SOURCES))
    return {fixture: (artifacts[fixture], theirs[fixture]) for fixture in SOURCES}


@pytest.mark.parametrize("fixture", list(SOURCES))
def test_sm80_fp8_expert_groups_are_vllms_marlin_bytes(
    fixture: str, sm80_and_vllm: dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]
) -> None:
    artifact, vllm = sm80_and_vllm[fixture]
    manifest = Manifest.load(artifact)
    for group, theirs in vllm.items():
        entry = manifest.expert_groups[group]
        assert entry.kernel == "fp8_marlin_moe"
        with safe_open(str(artifact / "rank0.safetensors"), "pt") as f:
            for key, want in theirs.items():
                got = f.get_tensor(f"{group}.{key}")
                assert got.shape == want.shape and got.dtype == want.dtype, (group, key)
                assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), (group, key)
