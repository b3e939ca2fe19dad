"""Refactors change no artifact byte: fixed synthetic checkpoints convert to artifacts whose ids, rank
files and manifests hash to values recorded before the structure refactor.

Covered: every GPU layout (Marlin int4 with act-order and asymmetric zeros, GPTQ-standard, FP8 W8A8,
FP8 Marlin, FP8 W8A16 block, dense), the CPU FP8 / int8 / dense forms, online FP8 and TP=2.
`cpu_int4` is left out: its packed bytes follow the running CPU's int4 layout (see
kernels/cpu_int4.py), so they differ between machines by design. The manifest is hashed with its
volatile fields (creation time, version, timing, the source's temporary path) and the wording of
kernel rejection reasons blanked (which kernels were rejected is kept).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.artifact.manifest import MANIFEST_NAME
from services.convert.library import ConversionRequest, convert

# name -> (synthetic checkpoint, target, tp, method, fp8 scheme)
CASES: dict[str, tuple[str, str, int, str, str]] = {
    "gptq-actorder-sm80": ("gptq-w4-actorder", "sm80", 1, "auto", "tensor"),
    "gptq-asym-sm80-tp2": ("gptq-w4-v2-asym", "sm80", 2, "auto", "tensor"),
    "gptq-asym-sm75": ("gptq-w4-v1-asym", "sm75", 1, "auto", "tensor"),
    "awq-sm86": ("awq-gemm", "sm86", 1, "auto", "tensor"),
    "ct-w8a16-sm90": ("ct-w8a16", "sm90", 1, "auto", "tensor"),
    "ct-fp8-channel-sm90": ("ct-fp8-channel", "sm90", 1, "auto", "tensor"),
    "fp8-tensor-sm80": ("fp8-tensor", "sm80", 1, "auto", "tensor"),
    "fp8-block-sm89": ("fp8-block", "sm89", 1, "auto", "tensor"),
    "fp8-tensor-cpu": ("fp8-tensor", "cpu", 1, "auto", "tensor"),
    "ct-int8-cpu": ("ct-int8", "cpu", 1, "auto", "tensor"),
    "bf16-cpu": ("bf16", "cpu", 1, "auto", "tensor"),
    "bf16-online-fp8-block-sm90": ("bf16", "sm90", 1, "fp8", "block"),
    "bf16-online-fp8-channel-cpu-tp2": ("bf16", "cpu", 2, "fp8", "channel"),
}
VOLATILE = ("created_at", "kiln_version")

# Recorded before the structure refactor: case -> (artifact id, sha256 of each file but the manifest,
# sha256 of the canonical manifest). Re-recorded once since, for artifact revision 2 (config.json
# carries Kiln's quantization config, runtime/artifact/hf_config.py): ids, config.json and manifests
# changed, every rank file hashed as before.
GOLDEN: dict[str, tuple[str, dict[str, str], str]] = {
    "awq-sm86": (
        "ka-ac0fa56edf1b0b0109461cbfb47e70b8",
        {
            "config.json": "a1b70a4c2b52868104aa8b80b444a80cecf0baa17426d85a79c4f63dfbd7521e",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6481a8474360de3ee5ace55228668263b001250f5414866665a7f9aa76bf4575",
        },
        "d5c35bf15292b5dd777bb21fad46b0df0c21622bc999d40b4a6fa4dca04ef5ee",
    ),
    "bf16-cpu": (
        "ka-cf13b7df242e17f0ce87b0e6160629e5",
        {
            "config.json": "1fab248ec1d1b466dd1d949cf52aed03d20cf4d8aab90b785cc03ca0d4be3ba2",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ab7fa77ca9d4e9cacd7e8016d5dc27dad98f5fe6bf52c55c749197468deac076",
        },
        "b7bddbef336678dac4273a3ced9f302da0b6e095043a3320bcfe06a220781b3a",
    ),
    "bf16-online-fp8-block-sm90": (
        "ka-688bb92963cc77683ec180159a0a5536",
        {
            "config.json": "88e32f55056238ee385ad262c6a83a03b1ae883e8b45a40683c5e5419119b0a2",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "21eaf5bc2dcdcceaf6dbdc1c47e4cef46326eaaf7cbba49d13655f0c3c2aa0e6",
    ),
    "bf16-online-fp8-channel-cpu-tp2": (
        "ka-c465615c11b05c2584d506abb3769ece",
        {
            "config.json": "4e90523f1819ca09cbb0bd1c2841d6d85387e8239b520b620c79fe1d3fb804d3",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "12af9619de0ce49a8bb18837404b83686df19c07477d44a060431dd8b6f4fb3f",
            "rank1.safetensors": "cf222571178cd3dcc14175031732b42a450134e9c379cf1ed5ce491387e2c419",
        },
        "b74a3d5b4d9aedbdc43647fca956507633cb6c1ebf5d0e33f73bd20d7b316204",
    ),
    "ct-fp8-channel-sm90": (
        "ka-977641b5c6484e4f118257781f6b0f43",
        {
            "config.json": "dbd9793584dfd070af52adb72a1382d7d0a3ef659897e29d5ac5ba52c204a89c",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ae4d4f0f866d28f8d2feb7e68131c1ff61333a6e0288960c12649495f6c44cb7",
        },
        "7cb296f3b329c0a203e85a4e10a69fa344efe1357e4300bb8a3a505a1647bc35",
    ),
    "ct-int8-cpu": (
        "ka-892c8730c42848d5be1cb62615e7d2cf",
        {
            "config.json": "f6fb66f05b98d9a865b1951e6f3fa3253e162c190c2ca65041903b111b0ba30e",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6f0fe3c35dd2a4561e509f9b9c6b4ce79d22e21c1b7219aae7da4a340ca16501",
        },
        "c68cc390c1e05b292d311f0f413bff3339be30500e1bf576b82ad0ea0c4c1e45",
    ),
    "ct-w8a16-sm90": (
        "ka-45af177d9859d6543090386a710ee3d2",
        {
            "config.json": "02a2c4eeba7d824df4bd5ca8a7efc894987faf0817c7c693138700932ff9ae15",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "c1c34b84965ec46ae617135477557988d1306ae9fab0a875eeab316ce3763e47",
        },
        "5ec8b99249d5559876dffc66ee1943d7647a0f1a81596893ef90147dda38653b",
    ),
    "fp8-block-sm89": (
        "ka-01f6a58482df1c3488687267d19921c3",
        {
            "config.json": "6b109a330ce253d8010cb74b9507eb1b124c1ad20d0b46a9d3dffb260c26bb20",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "68d398ff19ea9952995b53414e32c5edce4464f58e23e6e08e899b35c1ed06d8",
    ),
    "fp8-tensor-cpu": (
        "ka-b3e9e1e303c1f0a9501905f5b6204959",
        {
            "config.json": "5f9844e224b12e4e3fc0369f24b09e4524e5c4c48e0be77609c3f124732d452a",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "735bff3b14f77cfcb700d1317b2ba7b4c341776b2332aeb4d0f8505e80c0eb0d",
        },
        "34280cb396c0f220deba86a9075a34bebfb60563044bcf607c5b667e65b10978",
    ),
    "fp8-tensor-sm80": (
        "ka-5b4ab84727511955b97b6ebdb7e43ace",
        {
            "config.json": "181d3bb1f9fd64258a76f2f2253f6b3a2fae5e131ad578db5091229a8cec574a",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ef331ab737201ee823a3916d9ec31cac4a8c35b73407ee78149a702b23eeb79f",
        },
        "aa3012589b0390efaf76ecc92131b9ae4200ed574328e1f465e0c533a459fd7e",
    ),
    "gptq-actorder-sm80": (
        "ka-7594563bb9504ece340365b974e4d1fc",
        {
            "config.json": "490bedbef5a4a4e1617961bdbaaa9439ad5175ff6dca007acae13fbe3bd7ebba",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "97efe509531b44176bb120c250e281dc33564f906c79f73f77636e9ef374cc75",
        },
        "d73c54c6397de2da5f6c4e34330c644e78c8d6a46575ae8c9fb51a6bb26b757b",
    ),
    "gptq-asym-sm75": (
        "ka-e7b0f7d16cbfcc22dfec9272ed9106fd",
        {
            "config.json": "e068afc7f74d09e9f29d30987c11605aa425bc25c4f5a6a9d8db374ac15e1947",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "0fc2208fc2692348a4b76ab08a441e9563cedde0d78c241164735bbaecb6440b",
        },
        "9004c051dbf258c6277ee94f505a17fe8a7d27835f57de3a65a41cb6768efee4",
    ),
    "gptq-asym-sm80-tp2": (
        "ka-0d5f457c1fddbe0b810327b6ce884409",
        {
            "config.json": "016190fce39822f23671bd736c70bd71230f5fa1b90307743b13ee308ced7d7d",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "67d852d990fc557d5fb0121315ad6c38f5d9cc8caff0323513ac9e23a0ae7730",
            "rank1.safetensors": "1e87616a71da745e4da9a90701d652a3b386f8f50102ddfb1cf7c433668b522e",
        },
        "52e0171e3394b4e645aa0df9b41ef90299fc91544cc1db5ffb7fd6c7e555c347",
    ),
}


def _manifest_digest(raw: bytes) -> str:
    doc = json.loads(raw)
    for key in VOLATILE:
        doc[key] = ""
    doc["verification"]["seconds"] = 0.0
    doc["source"]["uri"] = ""
    for layer in doc["layers"].values():  # which kernels were rejected stays; their prose may improve
        for rejection in layer["rejected"]:
            rejection["reason"] = ""
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def fingerprint(artifact: Path) -> tuple[str, dict[str, str], str]:
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(artifact.iterdir())
        if p.name != MANIFEST_NAME
    }
    return artifact.name, files, _manifest_digest((artifact / MANIFEST_NAME).read_bytes())


@pytest.mark.parametrize("case", sorted(CASES))
def test_artifact_bytes_are_unchanged(ckpt: Callable[[str], Path], tmp_path: Path, case: str) -> None:
    name, target, tp, method, scheme = CASES[case]
    req = ConversionRequest(
        str(ckpt(name)), [target], tp=tp, method=method, fp8_scheme=scheme, out=str(tmp_path / "out")
    )
    result = convert(req)[0]
    assert fingerprint(Path(result.uri)) == GOLDEN[case]
