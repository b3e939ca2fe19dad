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
# changed, every rank file hashed as before. Re-recorded for the int8 W8A8 kernels (int8_w8a8,
# cpu_w8a8): every manifest lists them where they were tried and rejected; ct-int8-cpu declares
# dynamic per-token int8 activations, so its layers moved from cpu_int8 to cpu_w8a8 (fp32 scales):
# its id, config.json and rank file changed; every other rank file and id hashed as before.
# Re-recorded for the FP4 kernels (marlin_fp4, cpu_fp4): manifests list them where they were tried and
# rejected; every id and every other file hashed as before.
# Re-recorded for cpu_w4a8 (ahead of cpu_int4 on the cpu target): the cpu manifests list it where it was
# tried and rejected; every id and every other file hashed as before.
# Re-recorded for the value-table kernels (tile_lut4, cpu_lut4; bitsandbytes NF4 / FP4): manifests list
# them where they were tried and rejected; every id and every other file hashed as before.
GOLDEN: dict[str, tuple[str, dict[str, str], str]] = {
    "awq-sm86": (
        "ka-ac0fa56edf1b0b0109461cbfb47e70b8",
        {
            "config.json": "a1b70a4c2b52868104aa8b80b444a80cecf0baa17426d85a79c4f63dfbd7521e",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6481a8474360de3ee5ace55228668263b001250f5414866665a7f9aa76bf4575",
        },
        "cba114b6cfd3cd352067763e6204f18e860408cf52f48e63a43f722686d1c6a0",
    ),
    "bf16-cpu": (
        "ka-cf13b7df242e17f0ce87b0e6160629e5",
        {
            "config.json": "1fab248ec1d1b466dd1d949cf52aed03d20cf4d8aab90b785cc03ca0d4be3ba2",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ab7fa77ca9d4e9cacd7e8016d5dc27dad98f5fe6bf52c55c749197468deac076",
        },
        "c62fbb3d3f460477c01081e95d70bf29ba6e6f34c20e839d9de9691e9906b39e",
    ),
    "bf16-online-fp8-block-sm90": (
        "ka-688bb92963cc77683ec180159a0a5536",
        {
            "config.json": "88e32f55056238ee385ad262c6a83a03b1ae883e8b45a40683c5e5419119b0a2",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "efece0652a4297df5ebdd0bf0bc0c07a44dfbf1178e421d116c46ceda0aa64bd",
    ),
    "bf16-online-fp8-channel-cpu-tp2": (
        "ka-c465615c11b05c2584d506abb3769ece",
        {
            "config.json": "4e90523f1819ca09cbb0bd1c2841d6d85387e8239b520b620c79fe1d3fb804d3",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "12af9619de0ce49a8bb18837404b83686df19c07477d44a060431dd8b6f4fb3f",
            "rank1.safetensors": "cf222571178cd3dcc14175031732b42a450134e9c379cf1ed5ce491387e2c419",
        },
        "7ca33a8724b4c5bd4287c924ebae45c634618449a6496ce942dfba4350e1a05f",
    ),
    "ct-fp8-channel-sm90": (
        "ka-977641b5c6484e4f118257781f6b0f43",
        {
            "config.json": "dbd9793584dfd070af52adb72a1382d7d0a3ef659897e29d5ac5ba52c204a89c",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ae4d4f0f866d28f8d2feb7e68131c1ff61333a6e0288960c12649495f6c44cb7",
        },
        "f287f4c248f2972bd357c1a42c3641dd3a17cd8d83679ebd336ee34880906500",
    ),
    "ct-int8-cpu": (
        "ka-fd4b8b37f02ee15c87bfb75425ddab3f",
        {
            "config.json": "dcf9ebefad2214bf9d726d1c87c232de172ee13ecb6ab865e2205cd0cca38ca9",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "1f84b41adcec155ae35734536612c7f30d8f9e3c074d93e9406ac8b0fd898ccb",
        },
        "9b8b3ea4ecb36db03c42d5ac75e52b2da991e7a52bebd6d6d9b21a614431623b",
    ),
    "ct-w8a16-sm90": (
        "ka-45af177d9859d6543090386a710ee3d2",
        {
            "config.json": "02a2c4eeba7d824df4bd5ca8a7efc894987faf0817c7c693138700932ff9ae15",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "c1c34b84965ec46ae617135477557988d1306ae9fab0a875eeab316ce3763e47",
        },
        "b210d58d38e151a0caa381f3ce9556a5a511f6d33bc871b5a8839beb37b33ac5",
    ),
    "fp8-block-sm89": (
        "ka-01f6a58482df1c3488687267d19921c3",
        {
            "config.json": "6b109a330ce253d8010cb74b9507eb1b124c1ad20d0b46a9d3dffb260c26bb20",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "a876ddf5eae8ee570078d20392baf17d4a3ea05e8c4ca3a40094d661a258dd54",
    ),
    "fp8-tensor-cpu": (
        "ka-b3e9e1e303c1f0a9501905f5b6204959",
        {
            "config.json": "5f9844e224b12e4e3fc0369f24b09e4524e5c4c48e0be77609c3f124732d452a",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "735bff3b14f77cfcb700d1317b2ba7b4c341776b2332aeb4d0f8505e80c0eb0d",
        },
        "c0dc9cf00e647a1228535a0daeec37d8c3c5ab8a69dd1ecead5eac4b9ea2419c",
    ),
    "fp8-tensor-sm80": (
        "ka-5b4ab84727511955b97b6ebdb7e43ace",
        {
            "config.json": "181d3bb1f9fd64258a76f2f2253f6b3a2fae5e131ad578db5091229a8cec574a",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ef331ab737201ee823a3916d9ec31cac4a8c35b73407ee78149a702b23eeb79f",
        },
        "b877343634de0eee741ad93beffe7b7a0cf6935bea3eac16c218733ad7326b6d",
    ),
    "gptq-actorder-sm80": (
        "ka-7594563bb9504ece340365b974e4d1fc",
        {
            "config.json": "490bedbef5a4a4e1617961bdbaaa9439ad5175ff6dca007acae13fbe3bd7ebba",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "97efe509531b44176bb120c250e281dc33564f906c79f73f77636e9ef374cc75",
        },
        "ccf3255b0049f548afbbc3a8f7d81da97d31f5f9d6e22cae4e7bd79beeaf17f9",
    ),
    "gptq-asym-sm75": (
        "ka-e7b0f7d16cbfcc22dfec9272ed9106fd",
        {
            "config.json": "e068afc7f74d09e9f29d30987c11605aa425bc25c4f5a6a9d8db374ac15e1947",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "0fc2208fc2692348a4b76ab08a441e9563cedde0d78c241164735bbaecb6440b",
        },
        "f21d802e0d7794d2f2f3365a9fd806fdf234e75aa6948aeae6415acffef27d60",
    ),
    "gptq-asym-sm80-tp2": (
        "ka-0d5f457c1fddbe0b810327b6ce884409",
        {
            "config.json": "016190fce39822f23671bd736c70bd71230f5fa1b90307743b13ee308ced7d7d",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "67d852d990fc557d5fb0121315ad6c38f5d9cc8caff0323513ac9e23a0ae7730",
            "rank1.safetensors": "1e87616a71da745e4da9a90701d652a3b386f8f50102ddfb1cf7c433668b522e",
        },
        "67c117b9f921eb6f63ba6277f111a60049c31b1b694a011519aab14bdf091bc1",
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
