"""AutoRound checkpoints written by auto-round 0.15 itself (RTN, `iters=0`, on CPU) in its own format:
symmetric exports pack AutoGPTQ's layout ("auto_round:auto_gptq"), asymmetric ones AutoAWQ's
("auto_round:auto_awq"). Each plans for sm80, sm90 and cpu; every layer of the artifacts equals
auto-round's own dequantization (its QuantLinear's forward / its AWQ `dequantize_gemm`); the CPU
artifact serves the log-probs transformers computes in fp32 on those weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devtools.builders.tiny_artifacts import save_checkpoint, tiny_hf_model
from services.convert.library import ConversionRequest, convert, plan
from tests.helpers.producers import producer_rows, served_log_prob_delta, stored_layers, with_weights

pytest.importorskip("auto_round")

GROUP = 64
SCALE_ROUNDING = 2.0**-7  # fp16 scales in bf16: 2^-8 relative, on codes up to 15 steps from the zero
LOGPROB_MEAN_ABS_TOL = 0.05  # bf16 activations against the fp32 reference
PROMPT = [[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65]]


def _quantize(src: Path, out: Path, *, sym: bool) -> Path:
    """`src` quantized by AutoRound (RTN) and saved in its own format; the checkpoint directory."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    rounder = AutoRound(model, tokenizer, bits=4, group_size=GROUP, sym=sym, iters=0, disable_opt_rtn=True)
    rounder.quantize_and_save(str(out), format="auto_round")
    [config] = out.glob("*/config.json")  # auto-round writes into a sub-directory named for the scheme
    return config.parent


def _producer_weights(ckpt: Path, *, sym: bool) -> dict[str, torch.Tensor]:
    """Every quantized module's (N, K) weight as auto-round dequantizes it (fp16, as it computes)."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    modules = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
    out = {}
    for m in modules:
        qweight, qzeros, scales = (tensors[f"{m}.{s}"] for s in ("qweight", "qzeros", "scales"))
        if sym:  # auto_round:auto_gptq packs with its zp-1 QuantLinear; the identity in gives W^T out
            from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

            k, n = qweight.shape[0] * 8, qweight.shape[1]
            layer = QuantLinear(4, GROUP, k, n, bias=False)
            layer.qweight.copy_(qweight)
            layer.qzeros.copy_(qzeros)
            layer.scales.copy_(scales)
            with torch.no_grad():
                out[m] = layer(torch.eye(k, dtype=torch.float16)).T.float()
        else:  # auto_round:auto_awq
            from auto_round.export.export_to_awq.utils import dequantize_gemm

            out[m] = dequantize_gemm(qweight, qzeros, scales, 4, GROUP).T.float()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("auto-round")
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return save_checkpoint(model, root / "fp32"), model


@pytest.mark.parametrize("sym", [True, False], ids=["auto_gptq-sym", "auto_awq-asym"])
def test_autoround_checkpoints_plan_everywhere_and_equal_autorounds_dequantization(
    tiny: tuple[Path, torch.nn.Module], sym: bool, tmp_path: Path
) -> None:
    src, model = tiny
    ckpt = _quantize(src, tmp_path / "q", sym=sym)
    for target in ("sm80", "sm90", "cpu"):
        p = plan(str(ckpt), target)
        qkv = next(r for r in p.rows if r.layer == "model.layers.0.self_attn.qkv_proj")
        assert qkv.scheme.startswith(f"int4 g{GROUP} {'sym' if sym else 'asym'}"), (target, qkv)
        assert any("AutoRound auto_round:auto_" in n for n in p.notes)
    producer = _producer_weights(ckpt, sym=sym)
    weight_only = {"quantize_head": "none", "int8_activations": False}
    results = convert(ConversionRequest(str(ckpt), ["cpu", "sm80"], out=str(tmp_path / "out"), **weight_only))  # type: ignore[arg-type]
    for r in results:
        assert r.manifest.verification.ok and r.manifest.source.format == "auto-round"
        for layer, spec, got in stored_layers(r):
            want = producer_rows(producer, spec, layer)
            # the producer computes in fp16; the kernels keep its fp16 scales in bf16 (cpu_int4 keeps
            # (8 - z) * s exact beside the rounded scale): within bf16 steps of the row's largest weight
            bound = SCALE_ROUNDING * want.abs().amax(dim=1, keepdim=True)
            assert bool(((got - want).abs() <= bound).all()), (r.target, layer)
    cpu = next(r for r in results if r.target.value == "cpu")
    reference = with_weights(model, producer)
    assert served_log_prob_delta(cpu.uri, reference, PROMPT) <= LOGPROB_MEAN_ABS_TOL


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("data_type", "mx_fp", "data_type 'mx_fp'"), ("packing_format", "auto_round:gptqmodel", "gptqmodel"),
     ("extra_config", {"model.layers.0.mlp.down_proj": {"bits": 8}}, "extra_config")],
)  # fmt: skip
def test_autoround_variants_kiln_does_not_read_are_refused_with_the_supported_list(
    tiny: tuple[Path, torch.nn.Module], tmp_path: Path, field: str, value: object, match: str
) -> None:
    import json
    import shutil

    from kernels.errors import UnsupportedError

    ckpt = shutil.copytree(_quantize(tiny[0], tmp_path / "q", sym=True), tmp_path / "edited")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"][field] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match=match) as info:
        plan(str(ckpt), "sm80")
    assert "Kiln supports:" in str(info.value)
