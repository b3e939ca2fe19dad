"""bitsandbytes checkpoints written by transformers + bitsandbytes itself (its CPU backend): NF4 with
double quantization, FP4, and LLM.int8.

Each plans for sm80, sm90 and cpu; every layer of the artifacts is checked against bitsandbytes' own
dequantization (`dequantize_4bit`, `int8_vectorwise_dequant`), and the CPU artifact of SmolLM2-135M
quantized to NF4 serves the log-probs transformers computes in fp32 on bitsandbytes' dequantized
weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from devtools.builders import smollm2
from devtools.builders.tiny_artifacts import save_checkpoint, tiny_hf_model
from services.convert.library import ConversionRequest, convert, plan
from tests.helpers.producers import producer_rows, served_log_prob_delta, stored_layers, with_weights

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

LOGPROB_MEAN_ABS_TOL = 0.05
# the int8 kernels keep the row scale SCB / 127 in bf16, as for every checkpoint (verified "max_step_err")
INT8_REL_TOL = 2.0**-8
KINDS = ("nf4-dq", "fp4", "int8")


def _config(kind: str):  # transformers' BitsAndBytesConfig
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind.removesuffix("-dq"),
        bnb_4bit_use_double_quant=kind.endswith("-dq"),
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def _quantized(src: Path, out: Path, kind: str) -> torch.nn.Module:
    """`src` loaded through bitsandbytes (`kind`) and saved to `out`; the quantized model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=_config(kind), device_map="cpu", dtype=torch.bfloat16
    )
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    return model


def _bnb_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized module's weight as bitsandbytes dequantizes it, in fp32."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            saved, state.dtype = state.dtype, torch.float32
            out[name] = F.dequantize_4bit(module.weight.data, state).float()
            state.dtype = saved
        elif isinstance(module, bnb.nn.Linear8bitLt):
            out[name] = F.int8_vectorwise_dequant(module.weight.data, module.weight.SCB).float()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """A tiny Llama quantized each way: (checkpoint, bitsandbytes' dequantized weights)."""
    root = tmp_path_factory.mktemp("bnb")
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    src = save_checkpoint(model.to(torch.bfloat16), root / "bf16")
    out = {}
    for kind in KINDS:
        quantized = _quantized(src, root / kind, kind)
        out[kind] = (root / kind, _bnb_weights(quantized))
    return out


EXPECTED_KERNELS = {
    "nf4-dq": ("tile_lut4", "cpu_lut4"),
    "fp4": ("tile_lut4", "cpu_lut4"),
    "int8": ("marlin_wna16", "cpu_int8"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_target_plans_and_every_layer_is_bitsandbytes_dequantization(
    tiny: dict[str, tuple[Path, dict[str, torch.Tensor]]], kind: str, tmp_path: Path
) -> None:
    src, reference = tiny[kind]
    gpu_kernel, cpu_kernel = EXPECTED_KERNELS[kind]
    for target in ("sm80", "sm90", "cpu"):
        rows = {r.layer: r for r in plan(str(src), target, quantize_head="none").rows}
        want = cpu_kernel if target == "cpu" else gpu_kernel
        assert rows["model.layers.0.self_attn.qkv_proj"].kernel == want, (target, rows)
        assert rows["lm_head"].kernel == "dense"
    if kind != "int8":
        row = next(r for r in plan(str(src), "cpu").rows if r.layer == "model.layers.0.mlp.down_proj")
        assert row.scheme == f"{kind.removesuffix('-dq')} (int4 codes into a value table) g64"
    results = convert(
        ConversionRequest(str(src), ["cpu", "sm80"], out=str(tmp_path / "out"), quantize_head="none")
    )
    for r in results:
        assert r.manifest.verification.ok and r.manifest.source.format == "bitsandbytes", (
            r.manifest.verification
        )
        for layer, spec, got in stored_layers(r):
            want = producer_rows(reference, spec, layer)
            if kind == "int8":
                rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
                assert rel <= INT8_REL_TOL, (r.target, layer, rel)
            else:
                assert torch.equal(got, want), (r.target, layer)


def test_nf4_layers_split_over_tensor_parallel_ranks(
    tiny: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    """tp=2: column-parallel q/k/v and gate/up keep their value table and absmax rows, row-parallel
    o/down their groups of K; every rank verifies against the source."""
    src, _ = tiny["nf4-dq"]
    results = convert(ConversionRequest(str(src), ["cpu", "sm90"], tp=2, out=str(tmp_path / "out")))
    for r in results:
        assert r.manifest.tp == 2 and r.manifest.verification.ok, (r.target, r.manifest.verification)
        kernels = {e.kernel for n, e in r.manifest.layers.items() if n != "lm_head"}
        assert kernels == {"cpu_lut4" if r.target.value == "cpu" else "tile_lut4"}, kernels


def test_smollm2_nf4_serves_bitsandbytes_log_probs(tmp_path: Path) -> None:
    """SmolLM2-135M quantized to NF4 (double quantization) by bitsandbytes: the CPU artifact's prompt
    log-probs match transformers in fp32 on bitsandbytes' dequantized weights."""
    from transformers import AutoModelForCausalLM

    try:
        src = smollm2.build_bf16()
    except smollm2.CheckpointUnavailable as e:
        pytest.skip(str(e))
    quantized = _quantized(src, tmp_path / "nf4", "nf4-dq")
    original = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    reference = with_weights(original, _bnb_weights(quantized))
    del quantized
    [r] = convert(
        ConversionRequest(str(tmp_path / "nf4"), ["cpu"], out=str(tmp_path / "out"), quantize_head="none")
    )
    assert r.manifest.verification.ok
    assert {e.kernel for n, e in r.manifest.layers.items() if n != "lm_head"} == {"cpu_lut4"}
    prompt = [[1, 9690, 42, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2]]
    diff = served_log_prob_delta(r.uri, reference, prompt)
    print(f"\nSmolLM2 NF4 (bitsandbytes) on cpu_lut4: mean |Δ log-prob| {diff:.4f}")
    assert diff <= LOGPROB_MEAN_ABS_TOL
