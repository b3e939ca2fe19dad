"""NVIDIA ModelOpt checkpoints: a tiny random Llama quantized here as ModelOpt exports it (NVFP4, FP8
per-tensor / per-channel / 128x128 blocks, MIXED_PRECISION), in config.json (ModelOpt >= 0.31) and
hf_quant_config.json (<= 0.29) style. Detection and per-layer quantization, decoded weights equal to
this file's own dequantization bit for bit, bad inputs refused naming what is wrong, and cpu
conversions whose prompt log-probs follow transformers fp32 on the dequantized weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from devtools.builders.tiny_artifacts import save_checkpoint, tiny_hf_model
from devtools.eval import runtime_logits_fn
from kernels.base import E2M1_VALUES
from kernels.codecs.fp4 import pack_fp4
from kernels.errors import UnsupportedError
from runtime.loader import load_model
from runtime.model_layout import ModelConfig, linear_layouts
from services.convert.errors import ConversionError, QuantConfigError, TensorLayoutError
from services.convert.library import ConversionRequest, convert, open_and_detect, plan

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# ModelOpt gives the shards vLLM fuses one NVFP4 global scale
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
W4A16 = "nvfp4 (E2M1 + E4M3/16 + fp32 global)"
W4A4 = "nvfp4 (E2M1 + E4M3/16 + fp32 global, W4A4 source: activations run 16-bit)"
E4M3_MAX, E2M1_MAX = 448.0, 6.0
LOGPROB_MEAN_ABS_TOL = 0.05  # bf16 activations against the fp32 reference
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 200, 65]


# --- a ModelOpt exporter in miniature -------------------------------------------------------------


def _nvfp4(w: torch.Tensor, global_amax: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt NVFP4: weight_scale_2 = amax / (6 * 448), E4M3 scales per 16, nearest E2M1 codes."""
    n, k = w.shape
    scale_2 = (global_amax / (E2M1_MAX * E4M3_MAX)).float()
    blocks = w.reshape(n, k // 16, 16)
    scale = (blocks.abs().amax(-1) / E2M1_MAX / scale_2).to(torch.float8_e4m3fn)
    step = scale.float()[..., None] * scale_2
    x = torch.where(step > 0, blocks / step, torch.zeros_like(blocks))
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (x.abs()[..., None] - magnitudes).abs().argmin(-1).to(torch.uint8) | (
        (x < 0).to(torch.uint8) << 3
    )
    codes = codes.reshape(n, k)
    values = torch.tensor(E2M1_VALUES)[codes.long()]
    dequant = (values * scale.float().repeat_interleave(16, 1)) * scale_2
    tensors = {"weight": pack_fp4(codes), "weight_scale": scale, "weight_scale_2": scale_2.reshape(())}
    return tensors, dequant


def _fp8(w: torch.Tensor, algo: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt FP8 (one scale per module), FP8_PER_CHANNEL_PER_TOKEN (per row), FP8_PB_WO (128x128)."""
    n, k = w.shape
    if algo == "FP8":
        scale = w.abs().amax() / E4M3_MAX
        full, stored = scale, scale.reshape(())
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        scale = w.abs().amax(1) / E4M3_MAX
        full, stored = scale[:, None], scale
    else:  # N is 64 or a multiple of 128 here, K a multiple of 128
        scale = w.reshape(-(-n // 128), -1, k // 128, 128).abs().amax((1, 3)) / E4M3_MAX
        full, stored = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1), scale[:, None, :, None]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": stored, "input_scale": torch.tensor(0.02)}, q.float() * full


def write_modelopt(
    path: Path,
    model: PreTrainedModel,
    algos: dict[str, str],
    quantization: dict[str, Any],
    *,
    legacy: bool = False,
    shared_global: bool = True,
) -> dict[str, torch.Tensor]:
    """`model` as a ModelOpt checkpoint: the modules in `algos` (checkpoint module -> quant_algo)
    quantized, every other tensor bf16; `quantization` is the config (config.json quantization_config,
    or with `legacy` hf_quant_config.json's "quantization"). Returns every tensor as the checkpoint
    decodes to it in float32 (the reference weights)."""
    save_checkpoint(model, path)
    tensors = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    reference = {k: v.float() for k, v in tensors.items()}
    amax: dict[str, torch.Tensor] = {}
    for module in algos:
        group = _group(module) if shared_global else module
        amax[group] = torch.maximum(
            amax.get(group, torch.tensor(0.0)), tensors[f"{module}.weight"].abs().max()
        )
    for module, algo in algos.items():
        w = tensors.pop(f"{module}.weight").float()
        if algo in NVFP4_ALGOS:
            quantized, reference[f"{module}.weight"] = _nvfp4(
                w, amax[_group(module) if shared_global else module]
            )
            if algo == "NVFP4":
                quantized["input_scale"] = torch.tensor(0.01)
        else:
            quantized, reference[f"{module}.weight"] = _fp8(w, algo)
        tensors.update({f"{module}.{name}": t for name, t in quantized.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    if legacy:
        side = {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quantization}
        (path / "hf_quant_config.json").write_text(json.dumps(side))
    else:
        config["quantization_config"] = {"quant_method": "modelopt", **quantization}
    (path / "config.json").write_text(json.dumps(config))
    return reference


def _group(module: str) -> str:
    parent, _, proj = module.rpartition(".")
    return f"{parent}.{FUSED.get(proj, proj)}"


def _modules(
    model: PreTrainedModel, layers: tuple[int, ...] = (0, 1), proj: tuple[str, ...] = PROJ
) -> list[str]:
    out = []
    for i in layers:
        for p in proj:
            block = "self_attn" if p in PROJ[:4] else "mlp"
            out.append(f"model.layers.{i}.{block}.{p}")
    assert all(f"{m}.weight" in model.state_dict() for m in out)
    return out


def _single(algo: str, **extra: Any) -> dict[str, Any]:
    """config.json-style quantization_config fields (without quant_method)."""
    return {"quant_algo": algo, "group_size": 16, "ignore": ["lm_head"], **extra}


def _legacy(algo: str, **extra: Any) -> dict[str, Any]:
    return {
        "quant_algo": algo,
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
        **extra,
    }


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_hf_model("llama", seed=3)


@pytest.fixture
def write(tmp_path: Path, model: PreTrainedModel) -> Callable[..., tuple[Path, dict[str, torch.Tensor]]]:
    """write(algos, quantization, name=..., **options) -> (checkpoint path, reference weights)."""

    def go(
        algos: dict[str, str], quantization: dict[str, Any], name: str = "ckpt", **options: Any
    ) -> tuple[Path, dict[str, torch.Tensor]]:
        path = tmp_path / name
        return path, write_modelopt(path, model, algos, quantization, **options)

    return go


def _decoded(path: Path) -> dict[str, torch.Tensor]:
    """checkpoint module -> the weight Kiln's ModelOpt reader decodes (float32), every linear module."""
    ckpt, fmt = open_and_detect(str(path))
    out = {}
    for layout in linear_layouts(ModelConfig.from_hf(ckpt.config), ckpt.has("lm_head.weight")):
        for shard in layout.shards:
            lq = fmt.layer_quant(shard.module, layout)
            tensors = ckpt.read(fmt.source_tensors(shard.module, lq))
            out[shard.module] = fmt.decode(shard.module, lq, tensors).dequantize()
    return out


def _schemes(path: Path) -> dict[str, str]:
    return {r.layer: r.scheme for r in plan(str(path), "cpu").rows}


# --- detection and per-layer quantization ---------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["config.json", "hf_quant_config.json"])
@pytest.mark.parametrize(
    ("algo", "scheme"),
    [
        ("FP8", "fp8 tensor"),
        ("FP8_PER_CHANNEL_PER_TOKEN", "fp8 channel"),
        ("FP8_PB_WO", "fp8 block 128x128"),
        ("NVFP4", W4A4),
        ("W4A16_NVFP4", W4A16),
    ],
)
def test_detects_each_algo_and_decodes_it_exactly(
    write: Callable[..., Any], model: PreTrainedModel, algo: str, scheme: str, legacy: bool
) -> None:
    algos = dict.fromkeys(_modules(model), algo)
    path, reference = write(algos, _legacy(algo) if legacy else _single(algo), legacy=legacy)
    _, fmt = open_and_detect(str(path))
    assert (fmt.name, fmt.describe()) == ("modelopt", f"ModelOpt {algo}")
    p = plan(str(path), "cpu")
    assert p.format == "modelopt"
    rows = {r.layer: r.scheme for r in p.rows}
    assert rows.pop("lm_head") == "dense"
    assert set(rows.values()) == {scheme} and len(rows) == 8
    if legacy:
        assert any("hf_quant_config.json" in n for n in p.notes)
    if algo.startswith("FP8"):
        assert any("input_scale" in n and "dynamically" in n for n in p.notes), p.notes
    for module, w in _decoded(path).items():
        assert torch.equal(w, reference[f"{module}.weight"]), module
    gpu = {r.layer: r.kernel for r in plan(str(path), "sm80").rows}
    assert gpu.pop("lm_head") == "dense"
    assert set(gpu.values()) == {"marlin_fp4" if "NVFP4" in algo else "fp8_marlin"}, gpu


def test_nvfp4_without_input_activations_is_w4a16(write: Callable[..., Any], model: PreTrainedModel) -> None:
    """vLLM reads quant_algo NVFP4 whose config_groups all declare no input activations as W4A16_NVFP4."""
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}, "input_activations": None}}
    path, _ = write(dict.fromkeys(_modules(model), "NVFP4"), _single("NVFP4", config_groups=groups))
    assert set(_schemes(path).values()) == {W4A16, "dense"}


def test_modelopt_fp4_quant_method_and_lowercase_algo(
    write: Callable[..., Any], model: PreTrainedModel
) -> None:
    path, _ = write(dict.fromkeys(_modules(model), "NVFP4"), _single("nvfp4"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "modelopt_fp4"
    (path / "config.json").write_text(json.dumps(cfg))
    assert open_and_detect(str(path))[1].describe() == "ModelOpt NVFP4"


def test_per_shard_global_scales_are_kept(write: Callable[..., Any], model: PreTrainedModel) -> None:
    """q / k / v with their own weight_scale_2: each shard keeps its multiplier (no max over shards)."""
    path, reference = write(
        dict.fromkeys(_modules(model), "W4A16_NVFP4"), _single("W4A16_NVFP4"), shared_global=False
    )
    tensors = load_file(str(path / "model.safetensors"))
    attn = "model.layers.0.self_attn"
    assert len({float(tensors[f"{attn}.{p}.weight_scale_2"]) for p in ("q_proj", "k_proj", "v_proj")}) == 3
    for module, w in _decoded(path).items():
        assert torch.equal(w, reference[f"{module}.weight"]), module


def test_mixed_precision_quantizes_the_listed_layers_only(
    write: Callable[..., Any], model: PreTrainedModel
) -> None:
    algos = {
        **dict.fromkeys(_modules(model, (0,), PROJ[:4]), "NVFP4"),
        **dict.fromkeys(_modules(model, (0,), PROJ[4:]), "FP8"),
        "model.layers.1.mlp.down_proj": "FP8_PB_WO",
    }
    layers = {m: {"quant_algo": a, **({"group_size": 16} if "NVFP4" in a else {})} for m, a in algos.items()}
    for legacy in (False, True):
        fields = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
        fields |= {"exclude_modules": ["lm_head"]} if legacy else {"ignore": ["lm_head"]}
        path, reference = write(algos, fields, name=f"mixed-{legacy}", legacy=legacy)
        assert _schemes(path) == {
            "model.layers.0.self_attn.qkv_proj": W4A4,
            "model.layers.0.self_attn.o_proj": W4A4,
            "model.layers.0.mlp.gate_up_proj": "fp8 tensor",
            "model.layers.0.mlp.down_proj": "fp8 tensor",
            "model.layers.1.self_attn.qkv_proj": "dense",
            "model.layers.1.self_attn.o_proj": "dense",
            "model.layers.1.mlp.gate_up_proj": "dense",
            "model.layers.1.mlp.down_proj": "fp8 block 128x128",
            "lm_head": "dense",
        }
        for module, w in _decoded(path).items():
            assert torch.equal(w, reference[f"{module}.weight"]), module


def test_exclusions_match_as_vllm_matches_them(write: Callable[..., Any], model: PreTrainedModel) -> None:
    """An exact shard name, a substring of vLLM's (fused) layer name, or an fnmatch glob of it; "x*"
    means x and its subtree (vLLM's rewrite), so "model.layers.1.mlp*" takes gate_up and down."""
    dense = {
        *_modules(model, (1,), PROJ[4:]),
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.k_proj",
    }
    dense |= {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "v_proj")}
    algos = {m: "FP8" for m in _modules(model) if m not in dense}
    ignore = ["lm_head", "model.layers.1.mlp*", "*.0.self_attn.o_pro?", "layers.1.self_attn.qkv"]
    path, reference = write(algos, _single("FP8", ignore=ignore))
    schemes = _schemes(path)
    assert {layer for layer, s in schemes.items() if s == "dense"} == {
        "lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.qkv_proj",
        "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj",
    }  # fmt: skip
    for module, w in _decoded(path).items():
        assert torch.equal(w, reference[f"{module}.weight"]), module


def test_quantized_lm_head_is_taken_when_stored_quantized(
    write: Callable[..., Any], model: PreTrainedModel
) -> None:
    algos = dict.fromkeys([*_modules(model), "lm_head"], "FP8")
    path, reference = write(algos, _single("FP8", ignore=[]))
    assert _schemes(path)["lm_head"] == "fp8 tensor"
    assert torch.equal(_decoded(path)["lm_head"], reference["lm_head.weight"])


# --- bad inputs ------------------------------------------------------------------------------------


def _set_quant(path: Path, **fields: Any) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            cfg["quantization_config"].pop(key, None)
        else:
            cfg["quantization_config"][key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def fp4_ckpt(write: Callable[..., Any], model: PreTrainedModel) -> Path:
    return write(dict.fromkeys(_modules(model), "NVFP4"), _single("NVFP4"))[0]


@pytest.mark.parametrize("algo", ["W4A8_AWQ", "MXFP8", "INT4_AWQ", "FP8_BLOCKWISE"])
def test_unsupported_algos_are_refused_by_name(fp4_ckpt: Path, algo: str) -> None:
    _set_quant(fp4_ckpt, quant_algo=algo)
    with pytest.raises(UnsupportedError, match=rf"ModelOpt quant_algo '{algo}'.*Kiln supports:.*ModelOpt"):
        plan(str(fp4_ckpt), "cpu")


def test_unsupported_algo_in_quantized_layers_names_the_layer(fp4_ckpt: Path) -> None:
    layers = {"model.layers.0.mlp.down_proj": {"quant_algo": "MXFP8"}}
    _set_quant(fp4_ckpt, quant_algo="MIXED_PRECISION", quantized_layers=layers)
    with pytest.raises(
        UnsupportedError, match=r"'MXFP8' \(quantized_layers\['model.layers.0.mlp.down_proj'\]\)"
    ):
        plan(str(fp4_ckpt), "cpu")


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"quant_algo": None}, QuantConfigError, "quant_algo must be a non-empty string"),
        ({"quant_algo": 4}, QuantConfigError, "quant_algo must be a non-empty string, got 4"),
        ({"ignore": "lm_head"}, QuantConfigError, "'ignore' must be a list"),
        ({"ignore": ["lm_head", 3]}, QuantConfigError, "ignore must list strings"),
        ({"group_size": "sixteen"}, QuantConfigError, "'group_size' must be an integer"),
        ({"group_size": 32}, UnsupportedError, "NVFP4 with group_size 32"),
        ({"kv_cache_scheme": "fp8"}, QuantConfigError, "kv_cache_scheme must be an object"),
        ({"quant_algo": "MIXED_PRECISION"}, QuantConfigError, "non-empty `quantized_layers`"),
        (
            {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"x": "FP8"}},
            QuantConfigError,
            r"\['x'\] must be an object",
        ),
        ({"ignore": ["[z-a]"]}, QuantConfigError, "ModelOpt quantization config ignore"),
    ],
)
def test_malformed_configs_name_the_field(
    fp4_ckpt: Path, fields: dict[str, Any], error: type[Exception], match: str
) -> None:
    _set_quant(fp4_ckpt, **fields)
    with pytest.raises(error, match=match):
        plan(str(fp4_ckpt), "cpu")


def test_malformed_legacy_side_config(write: Callable[..., Any], model: PreTrainedModel) -> None:
    path, _ = write(dict.fromkeys(_modules(model), "FP8"), _legacy("FP8"), legacy=True)
    side = json.loads((path / "hf_quant_config.json").read_text())
    side["quantization"] = "FP8"
    (path / "hf_quant_config.json").write_text(json.dumps(side))
    with pytest.raises(QuantConfigError, match="'quantization' must be an object"):
        plan(str(path), "cpu")


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_weight_scale_2_is_named(fp4_ckpt: Path) -> None:
    _edit_tensors(fp4_ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale_2"))
    with pytest.raises(ConversionError, match=r"lacks model\.layers\.1\.self_attn\.k_proj\.weight_scale_2"):
        plan(str(fp4_ckpt), "cpu")


def test_excluded_layer_stored_quantized_is_refused(fp4_ckpt: Path) -> None:
    _set_quant(fp4_ckpt, ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    with pytest.raises(
        ConversionError, match=r"model\.layers\.0\.mlp\.down_proj is stored quantized.*matched by ignore"
    ):
        plan(str(fp4_ckpt), "cpu")


def test_unlisted_mixed_layer_stored_quantized_is_refused(fp4_ckpt: Path, model: PreTrainedModel) -> None:
    layers = {m: {"quant_algo": "NVFP4"} for m in _modules(model) if "down" not in m}
    _set_quant(fp4_ckpt, quant_algo="MIXED_PRECISION", quantized_layers=layers)
    with pytest.raises(
        ConversionError, match=r"down_proj is stored quantized.*not listed in quantized_layers"
    ):
        plan(str(fp4_ckpt), "cpu")


def test_layer_the_config_quantizes_stored_otherwise_is_refused(fp4_ckpt: Path) -> None:
    _set_quant(fp4_ckpt, quant_algo="FP8")
    with pytest.raises(ConversionError, match=r"q_proj\.weight is U8, not F8_E4M3.*fix its ignore"):
        plan(str(fp4_ckpt), "cpu")


@pytest.mark.parametrize(
    ("tensor", "value", "match"),
    [
        ("weight_scale", lambda t: t.float(), "nvfp4 scales must be torch.float8_e4m3fn"),
        ("weight_scale_2", lambda t: torch.stack([t, t]), "weight_scale_2 must hold one global scale"),
        ("weight_scale", lambda t: t[:, :-1].contiguous(), r"nvfp4 scales are \(64, 7\)"),
        ("weight_scale_2", lambda t: torch.tensor(float("inf")), "global scale .* not finite"),
    ],
)
def test_bad_nvfp4_tensors_name_the_layer(fp4_ckpt: Path, tensor: str, value: Callable, match: str) -> None:
    name = f"model.layers.0.self_attn.k_proj.{tensor}"
    _edit_tensors(fp4_ckpt, lambda t: t.update({name: value(t[name])}))
    with pytest.raises(TensorLayoutError, match=rf"model\.layers\.0\.self_attn\.k_proj.*{match}"):
        _decoded(fp4_ckpt)


# --- end to end: convert for cpu, serve, compare with transformers ---------------------------------


def _reference_model(reference: dict[str, torch.Tensor]) -> PreTrainedModel:
    """The tiny Llama in fp32 with the weights the checkpoint decodes to."""
    ref = tiny_hf_model("llama", seed=3)
    ref.load_state_dict(reference)
    return ref.eval()


def _converts_and_follows_transformers(
    path: Path, reference: PreTrainedModel, out: Path, kernel: str
) -> None:
    rows = {r.layer: r for r in plan(str(path), "cpu").rows}
    assert {r.kernel for name, r in rows.items() if name != "lm_head"} == {kernel}
    [result] = convert(ConversionRequest(str(path), ["cpu"], out=str(out)))
    assert result.manifest.source.format == "modelopt"
    assert result.manifest.verification.ok
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        got = runtime_logits_fn(load_model(result.uri))(ids)[0].float().log_softmax(-1)
        want = reference(ids).logits[0].float().log_softmax(-1)
    assert (got - want).abs().mean().item() <= LOGPROB_MEAN_ABS_TOL


def test_fp8_checkpoint_converts_for_cpu_and_follows_transformers(
    write: Callable[..., Any], model: PreTrainedModel, tmp_path: Path
) -> None:
    path, reference = write(dict.fromkeys(_modules(model), "FP8"), _single("FP8"))
    _converts_and_follows_transformers(path, _reference_model(reference), tmp_path / "out", "cpu_fp8")


def test_nvfp4_checkpoint_converts_for_cpu_and_follows_transformers(
    write: Callable[..., Any], model: PreTrainedModel, tmp_path: Path
) -> None:
    path, reference = write(dict.fromkeys(_modules(model), "NVFP4"), _legacy("NVFP4"), legacy=True)
    _converts_and_follows_transformers(path, _reference_model(reference), tmp_path / "out", "cpu_fp4")


def test_hf_quant_config_json_is_hashed_and_kept_with_the_checkpoint(
    write: Callable[..., Any], model: PreTrainedModel
) -> None:
    path, _ = write(dict.fromkeys(_modules(model), "FP8"), _legacy("FP8"), legacy=True)
    ckpt, _ = open_and_detect(str(path))
    assert "hf_quant_config.json" in ckpt.file_hashes()
