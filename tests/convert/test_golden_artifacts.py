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
# sha256 of the canonical manifest).
GOLDEN: dict[str, tuple[str, dict[str, str], str]] = {
    "awq-sm86": (
        "ka-18bdff0bf9be97386263e666abc270e4",
        {
            "config.json": "70cbea9fda6a53cf21a7baf09b4b600df39e506bd6d6b2940c194f440de369eb",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6481a8474360de3ee5ace55228668263b001250f5414866665a7f9aa76bf4575",
        },
        "09843e5a32bb952b7575b4819a5cde0e9b015a056e0dd41925415672c1ec6fca",
    ),
    "bf16-cpu": (
        "ka-31fba428a73ada09b0f5736cc0cfa66e",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ab7fa77ca9d4e9cacd7e8016d5dc27dad98f5fe6bf52c55c749197468deac076",
        },
        "9e3b5048597852ffda0daaf77c7aa175f3c15aa9a2a042696a9825a6f04643c5",
    ),
    "bf16-online-fp8-block-sm90": (
        "ka-fe6d5c5775fb5dc5ce7c35df5b4125a4",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "6f69fd983f9a338ed8514107eb4ae278e52f9925784a72e2b42bfe0563cb125b",
    ),
    "bf16-online-fp8-channel-cpu-tp2": (
        "ka-c82c7acfa0da3864f0036900bff99e57",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "12af9619de0ce49a8bb18837404b83686df19c07477d44a060431dd8b6f4fb3f",
            "rank1.safetensors": "cf222571178cd3dcc14175031732b42a450134e9c379cf1ed5ce491387e2c419",
        },
        "de3a65f80a45f52cd4040ec78f8b2a2e010c7d37701d6af333bf166d3234e23f",
    ),
    "ct-fp8-channel-sm90": (
        "ka-35dac7197f2f65c6cc04d9800d38ec6d",
        {
            "config.json": "a548608d417c302fa6f73908bd53e1afbec0d5b13107f34116f77df11de68326",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ae4d4f0f866d28f8d2feb7e68131c1ff61333a6e0288960c12649495f6c44cb7",
        },
        "328c7d46ab59eac7ebb79c9760a4275a4a43fa35ec6bfe361ad09d54cd2e17d7",
    ),
    "ct-int8-cpu": (
        "ka-babd3124e8c4ac99fa631d437cd1577b",
        {
            "config.json": "62884e1ef1749135141fa0abebd3f988166915e6553b6b0c974d5bef0fdef379",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6f0fe3c35dd2a4561e509f9b9c6b4ce79d22e21c1b7219aae7da4a340ca16501",
        },
        "8d0330316679b950cdc454fc83c49ac49eba13531040b33fb521e44850e1e9c6",
    ),
    "ct-w8a16-sm90": (
        "ka-9ac5bf64944494233d710f08f4b08292",
        {
            "config.json": "df30a7701861bfb49596b1b22d9dba5e5d10bc20ae37e4f68a9aaa3687e9ea4b",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "c1c34b84965ec46ae617135477557988d1306ae9fab0a875eeab316ce3763e47",
        },
        "e5edd717c38f4f625c2e4f4ec1a0b6478bdc756ce360ec2fd3c9d36ed5c1175c",
    ),
    "fp8-block-sm89": (
        "ka-1f03b4610a197951626db55b83825a96",
        {
            "config.json": "28bc8f7d504890ade2ab9de1a3e0f1af700c26e7b0ca73caefe444b496a39218",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "fc6d82390f9d39562ed8cff2e6172006f48080f1b9ea55dfbc55be671e9277dc",
    ),
    "fp8-tensor-cpu": (
        "ka-cf6bc2915d96bdbcbb8b11193e0aa2f3",
        {
            "config.json": "10e7438fb4fe2c4e070bb62892b9c4f33d65fa1a0554d1ad46236e3311bf7f60",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "735bff3b14f77cfcb700d1317b2ba7b4c341776b2332aeb4d0f8505e80c0eb0d",
        },
        "9e1b8cf39e39b454b3e01f38b94497dcaa7659e10ed2830eeafcb4db687c00fd",
    ),
    "fp8-tensor-sm80": (
        "ka-e561b5f87b4a3964aabe0b728e513f32",
        {
            "config.json": "10e7438fb4fe2c4e070bb62892b9c4f33d65fa1a0554d1ad46236e3311bf7f60",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ef331ab737201ee823a3916d9ec31cac4a8c35b73407ee78149a702b23eeb79f",
        },
        "ce8f0b5b026087aeeb973d28a83f2f575f42fffac107b97a7d1455a235ba8993",
    ),
    "gptq-actorder-sm80": (
        "ka-e21dc81747e695d2a70161e106ca4973",
        {
            "config.json": "5c349bb7580da9401f7d14c1c08110afaa1f031cd37fee84058420d3b42a1496",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "97efe509531b44176bb120c250e281dc33564f906c79f73f77636e9ef374cc75",
        },
        "38cdf7308fb2bb8f0b9b6e675951e8474e45582c5cbc6369749c567744922ed2",
    ),
    "gptq-asym-sm75": (
        "ka-f913c5e1ab2bcdde8e6680644b4a38e2",
        {
            "config.json": "46d5d07e924a4c0bf4f0f87fbf025c64d0d800715fa334d720557a75f1cf0bda",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "0fc2208fc2692348a4b76ab08a441e9563cedde0d78c241164735bbaecb6440b",
        },
        "c3505f41ca228737298ae32fefb016f9d2eb949f124e3afcbf113051c08d6712",
    ),
    "gptq-asym-sm80-tp2": (
        "ka-f905036883f7bb84f9bc340493624590",
        {
            "config.json": "83fa8b7f4951f46f2898cd394be47b88b243f3e15216aab4d1d90bdcf7ffd728",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "67d852d990fc557d5fb0121315ad6c38f5d9cc8caff0323513ac9e23a0ae7730",
            "rank1.safetensors": "1e87616a71da745e4da9a90701d652a3b386f8f50102ddfb1cf7c433668b522e",
        },
        "a020a10abe3606aa387ed6ce4d63a74bb6821b80b2446da2db87ac010808da0c",
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
