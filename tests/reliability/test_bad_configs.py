"""Bad quantization configs and quantized tensors inconsistent with them or each other: each is refused
with the exact Kiln error class and a message naming the field / tensor / layer, never an IndexError,
TypeError, re.error or a RuntimeError from torch; a failed conversion leaves nothing in the store."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from devtools.builders.synthetic import Dims, write_checkpoint
from kernels.errors import KilnError, LayoutError, UnsupportedError
from services.convert.errors import ConversionError, QuantConfigError, TensorLayoutError
from services.convert.library import ConversionRequest, convert, open_and_detect, plan
from services.storage.local import LocalStore

SMALL = Dims(hidden=64, intermediate=128, layers=1, heads=2, kv_heads=1, head_dim=32, vocab=64)
Q = "model.layers.0.self_attn.q_proj"
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq": ("gptq", {"group_size": 32, "act_order": True}),
    "gptq-channel": ("gptq", {"group_size": -1}),
    "awq": ("awq", {"group_size": 32}),
    "fp8": ("fp8", {}),
    "fp8-block": ("fp8", {"fp8_strategy": "block", "block": (32, 32)}),
    "ct": ("ct-pack", {"group_size": 32, "act_order": True}),
    "ct-fp8": ("ct-fp8", {"fp8_strategy": "channel"}),
    "gptq8-asym-k128": (
        "gptq",
        {
            "bits": 8,
            "sym": False,
            "group_size": 64,
            "dims": Dims(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1, head_dim=64, vocab=64),
        },
    ),
}

ConfigEdit = Callable[[dict[str, Any]], None]
TensorEdit = Callable[[dict[str, torch.Tensor]], None]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("cfg")

    def get(name: str) -> Path:
        path = root / name
        if not path.exists():
            fmt, opts = BASES[name]
            write_checkpoint(path, fmt, **{"dims": SMALL, **opts})
        return path

    return get


def _variant(
    base: Path, dest: Path, cfg: ConfigEdit | None = None, tensors: TensorEdit | None = None
) -> Path:
    shutil.copytree(base, dest)
    if tensors is not None:
        t = load_file(str(dest / "model.safetensors"))
        tensors(t)
        save_file(t, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if cfg is not None:
        config = json.loads((dest / "config.json").read_text())
        cfg(config["quantization_config"])
        (dest / "config.json").write_text(json.dumps(config))
    return dest


def _convert_fails(src: Path, out: Path, cls: type[Exception], parts: tuple[str, ...]) -> None:
    with pytest.raises(KilnError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    assert type(info.value) is cls, (type(info.value), str(info.value))
    for part in parts:
        assert part in str(info.value), (part, str(info.value))
    if out.exists():
        store = LocalStore(out)
        assert store.list_ids() == [] and store.staging_entries() == []


def _set(*path_and_value: Any) -> ConfigEdit:
    *keys, value = path_and_value

    def edit(q: dict[str, Any]) -> None:
        for key in keys[:-1]:
            q = q[key]
        q[keys[-1]] = value

    return edit


def _pop(key: str) -> ConfigEdit:
    return lambda q: q.pop(key)


W0 = ("config_groups", "group_0", "weights")
# case -> (base, config edit, class, message parts)
CONFIG_CASES: dict[str, tuple[str, ConfigEdit, type[Exception], tuple[str, ...]]] = {
    "unknown_quant_method": (
        "awq",
        _set("quant_method", "zzz"),
        UnsupportedError,
        ("'zzz'", "Kiln supports"),
    ),
    "gptq_without_bits": ("gptq", _pop("bits"), QuantConfigError, ("GPTQ", "lacks 'bits'")),
    "gptq_without_group_size": ("gptq", _pop("group_size"), QuantConfigError, ("lacks 'group_size'",)),
    "gptq_bits_not_int": ("gptq", _set("bits", "four"), QuantConfigError, ("'bits'", "'four'")),
    "gptq_bits_bool": ("gptq", _set("bits", True), QuantConfigError, ("'bits'", "integer")),
    "gptq_group_size_zero": ("gptq", _set("group_size", 0), QuantConfigError, ("group_size", "got 0")),
    "gptq_bits_unsupported": ("gptq", _set("bits", 5), UnsupportedError, ("5 bits",)),
    "gptq_dynamic_bad_regex": ("gptq", _set("dynamic", {"+:(": {}}), QuantConfigError, ("'+:('", "regular")),
    "gptq_dynamic_not_object": ("gptq", _set("dynamic", {"+:.*": 5}), QuantConfigError, ("'+:.*'", "got 5")),
    "gptq_in_block_not_list": (
        "gptq",
        _set("modules_in_block_to_quantize", 5),
        QuantConfigError,
        ("modules_in_block_to_quantize",),
    ),
    "gptq_marlin_format": ("gptq", _set("checkpoint_format", "marlin"), UnsupportedError, ("'marlin'",)),
    "awq_gemv": ("awq", _set("version", "gemv"), UnsupportedError, ("'gemv'",)),
    "awq_bits_not_int": ("awq", _set("bits", "x"), QuantConfigError, ("bits|w_bit", "'x'")),
    "awq_not_convert_not_list": (
        "awq",
        _set("modules_to_not_convert", 3),
        QuantConfigError,
        ("modules_to_not",),
    ),
    "fp8_block_not_pair": ("fp8", _set("weight_block_size", 128), QuantConfigError, ("weight_block_size",)),
    "fp8_block_strings": ("fp8", _set("weight_block_size", ["a", "b"]), QuantConfigError, ("['a', 'b']",)),
    "fp8_ignored_not_list": ("fp8", _set("ignored_layers", 3), QuantConfigError, ("ignored_layers",)),
    "ct_extra_key_in_args": (
        "ct",
        _set(*W0, "bogus", 1),
        QuantConfigError,
        ("'bogus'", "QuantizationArgs", "group_0"),
    ),
    "ct_extra_key_in_scheme": (
        "ct",
        _set("config_groups", "group_0", "oops", 1),
        QuantConfigError,
        ("'oops'", "QuantizationScheme"),
    ),
    "ct_groups_not_object": ("ct", _set("config_groups", [1]), QuantConfigError, ("config_groups",)),
    "ct_weights_not_object": (
        "ct",
        _set("config_groups", "group_0", "weights", [1]),
        QuantConfigError,
        ("weights",),
    ),
    "ct_num_bits_not_int": ("ct", _set(*W0, "num_bits", "x"), QuantConfigError, ("num_bits", "group_0")),
    "ct_group_strategy_without_size": (
        "ct",
        _set(*W0, "group_size", -5),
        QuantConfigError,
        ("group_size", "group_0"),
    ),
    "ct_bad_ignore_regex": ("ct", _set("ignore", ["re:("]), QuantConfigError, ("'re:('", "regular")),
    "ct_sparsity_not_object": ("ct", _set("sparsity_config", "x"), QuantConfigError, ("sparsity_config",)),
    "ct_3bit_unsupported": ("ct", _set(*W0, "num_bits", 3), UnsupportedError, ("group_0", "int3")),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(case: str, bases: Callable[[str], Path], tmp_path: Path) -> None:
    base, edit, cls, parts = CONFIG_CASES[case]
    src = _variant(bases(base), tmp_path / "src", cfg=edit)
    _convert_fails(src, tmp_path / "out", cls, parts)


def test_quantization_config_that_is_not_an_object(bases: Callable[[str], Path], tmp_path: Path) -> None:
    src = _variant(bases("gptq"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = "gptq"
    (src / "config.json").write_text(json.dumps(config))
    _convert_fails(src, tmp_path / "out", QuantConfigError, ("quantization_config must be an object", "str"))


def _shrink(name: str, dim: int = 0) -> TensorEdit:
    return lambda t: t.__setitem__(name, t[name].narrow(dim, 0, t[name].shape[dim] - 1).contiguous())


def _poke(name: str, index: tuple[int, ...], value: float) -> TensorEdit:
    return lambda t: t[name].__setitem__(index, value)


def _replace(name: str, value: torch.Tensor) -> TensorEdit:
    return lambda t: t.__setitem__(name, value)


# case -> (base, config edit, tensor edit, message parts); all raise TensorLayoutError
TENSOR_CASES: dict[str, tuple[str, ConfigEdit | None, TensorEdit | None, tuple[str, ...]]] = {
    "gptq_scales_shape": ("gptq", None, _shrink(f"{Q}.scales"), (Q, "scale rows")),
    "gptq_qzeros_shape": ("gptq", None, _shrink(f"{Q}.qzeros"), (Q, "qzeros")),
    "gptq_g_idx_length": ("gptq", None, _shrink(f"{Q}.g_idx"), (Q, "g_idx", "(63,)")),
    "gptq_g_idx_out_of_range": ("gptq", None, _poke(f"{Q}.g_idx", (0,), 99), (Q, "g_idx", "99")),
    "gptq_g_idx_negative": ("gptq", None, _poke(f"{Q}.g_idx", (0,), -1), (Q, "g_idx", "-1")),
    "gptq_group_size_not_dividing_k": (
        "gptq",
        _set("group_size", 48),
        None,
        (Q, "group_size 48 does not divide K=64"),
    ),
    "gptq_bits_contradict_tensors": ("gptq", _set("bits", 8), None, ("qzeros", "bits=8")),
    "gptq_scales_nan": ("gptq", None, _poke(f"{Q}.scales", (0, 0), float("nan")), (Q, "non-finite", "nan")),
    "awq_scales_shape": ("awq", None, _shrink(f"{Q}.scales"), (Q, "AWQ shapes disagree")),
    "awq_group_size_not_dividing_k": ("awq", _set("group_size", 48), None, (Q, "group_size=48")),
    "fp8_scale_nan": ("fp8", None, _replace(f"{Q}.weight_scale", torch.tensor(float("nan"))), (Q, "nan")),
    "fp8_scale_inf": ("fp8", None, _replace(f"{Q}.weight_scale", torch.tensor(float("inf"))), (Q, "inf")),
    "fp8_scale_zero": ("fp8", None, _replace(f"{Q}.weight_scale", torch.tensor(0.0)), (Q, "zero", "0.0")),
    "fp8_scale_two_values": (
        "fp8",
        None,
        _replace(f"{Q}.weight_scale", torch.ones(2)),
        (Q, "one per-tensor"),
    ),
    "fp8_block_scale_shape": (
        "fp8-block",
        None,
        _shrink(f"{Q}.weight_scale_inv"),
        (Q, "(1, 2)", "expected (2, 2)"),
    ),
    "fp8_block_size_contradicts_scales": (
        "fp8-block",
        _set("weight_block_size", [16, 16]),
        None,
        (Q, "expected (4, 4)", "(16, 16)"),
    ),
    "fp8_block_scale_zero": ("fp8-block", None, _poke(f"{Q}.weight_scale_inv", (1, 1), 0.0), (Q, "zero")),
    "ct_scale_shape": ("ct", None, _shrink(f"{Q}.weight_scale", 1), (Q, "scales are (1, 64)", "G=2")),
    "ct_g_idx_out_of_range": ("ct", None, _poke(f"{Q}.weight_g_idx", (3,), 7), (Q, "g_idx", "7")),
    "ct_fp8_channel_scale_inf": (
        "ct-fp8",
        None,
        _poke(f"{Q}.weight_scale", (5, 0), float("inf")),
        (Q, "non-finite or zero", "(5,)"),
    ),
    "ct_fp8_channel_scale_shape": ("ct-fp8", None, _shrink(f"{Q}.weight_scale"), (Q,)),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_inconsistent_tensors(case: str, bases: Callable[[str], Path], tmp_path: Path) -> None:
    base, cfg, tensors, parts = TENSOR_CASES[case]
    src = _variant(bases(base), tmp_path / "src", cfg=cfg, tensors=tensors)
    out = tmp_path / "out"
    with pytest.raises(KilnError) as info:
        convert(ConversionRequest(str(src), ["cpu"], out=str(out)))
    err = info.value
    assert isinstance(err, TensorLayoutError | ConversionError), (type(err), str(err))
    assert isinstance(err, ConversionError)
    if not isinstance(err, TensorLayoutError):  # only the one-scale FP8 check predates TensorLayoutError
        assert case == "fp8_scale_two_values" or case == "ct_fp8_channel_scale_shape", (type(err), str(err))
    else:
        assert isinstance(err, LayoutError)
    for part in parts:
        assert part in str(err), (part, str(err))
    store = LocalStore(out)
    assert store.list_ids() == [] and store.staging_entries() == []


def test_desc_act_with_channelwise_groups_is_ignored_as_vllm_does(
    bases: Callable[[str], Path], tmp_path: Path
) -> None:
    """vLLM's GPTQConfig: desc_act with group_size -1 means no act-order (the permutation is moot)."""
    src = _variant(bases("gptq-channel"), tmp_path / "src", cfg=_set("desc_act", True))
    _, fmt = open_and_detect(str(src))
    assert fmt.name == "gptq"
    p = plan(str(src), "cpu")
    row = next(r for r in p.rows if r.layer.endswith("qkv_proj"))
    assert "act-order" not in row.scheme and "channel" in row.scheme
    results = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out")))
    assert results[0].manifest.verification.ok


def test_asym_8bit_on_a_marlin_target_falls_back_with_a_reason(
    bases: Callable[[str], Path], tmp_path: Path
) -> None:
    """sym=false with 8 bits contradicts Marlin (zero points only for uint4): the plan falls back to
    gptq_wna16 and says why, rather than failing or silently mis-packing."""
    p = plan(str(bases("gptq8-asym-k128")), "sm80")
    row = next(r for r in p.rows if r.layer.endswith("qkv_proj"))
    assert row.scheme == "int8 g64 asym" and row.kernel == "gptq_wna16"
    reasons = dict(row.rejections)
    assert "zero points only for 4-bit" in reasons["marlin_wna16"]


def test_pinned_method_contradicting_the_checkpoint(bases: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="already quantized") as info:
        convert(ConversionRequest(str(bases("gptq")), ["cpu"], method="fp8", out=str(tmp_path / "out")))
    assert "--method auto" in str(info.value)
    with pytest.raises(UnsupportedError, match="method 'int3' is not supported"):
        convert(ConversionRequest(str(bases("gptq")), ["cpu"], method="int3", out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists() or LocalStore(tmp_path / "out").list_ids() == []
