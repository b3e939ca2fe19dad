"""Refactors change no artifact byte: fixed synthetic checkpoints convert to artifacts whose ids, rank
files and manifests hash to values recorded before the structure refactor.

Covered: every GPU layout (Marlin int4 with act-order and asymmetric zeros, GPTQ-standard, FP8 W8A8,
FP8 Marlin, FP8 W8A16 block, dense), the CPU FP8 / int8 / dense forms, online FP8 and TP=2.
`cpu_int4` is left out: its packed bytes follow the running CPU's int4 layout (see
kernels/cpu_int4.py), so they differ between machines by design. The manifest is hashed with its
volatile fields (creation time, version, timing, the source's temporary path) blanked.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.artifact.manifest import MANIFEST_NAME
from services.convert.api import ConversionRequest, convert

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
        "940a02e197ed53edb1e330a28c238689e73c7e8e16df03b893c0aaa3d3d84c89",
    ),
    "bf16-cpu": (
        "ka-31fba428a73ada09b0f5736cc0cfa66e",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ab7fa77ca9d4e9cacd7e8016d5dc27dad98f5fe6bf52c55c749197468deac076",
        },
        "cc077fb5f3da2c183b53651ff3796862f47d02271f6ed1f6832b437c688280f5",
    ),
    "bf16-online-fp8-block-sm90": (
        "ka-fe6d5c5775fb5dc5ce7c35df5b4125a4",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "c1dfc5c13c55e1101cb3d220d7a98eebe9205181aece3cec5fc453bf3543b2eb",
    ),
    "bf16-online-fp8-channel-cpu-tp2": (
        "ka-c82c7acfa0da3864f0036900bff99e57",
        {
            "config.json": "2474acdf26197972e3954b9791e64380ac92ecab2f1f877f715c40f0ef015301",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "12af9619de0ce49a8bb18837404b83686df19c07477d44a060431dd8b6f4fb3f",
            "rank1.safetensors": "cf222571178cd3dcc14175031732b42a450134e9c379cf1ed5ce491387e2c419",
        },
        "4f192a2766afc4d0f84cdd85f7428463583cb3e5aa6b154badd28d8bd361056a",
    ),
    "ct-fp8-channel-sm90": (
        "ka-35dac7197f2f65c6cc04d9800d38ec6d",
        {
            "config.json": "a548608d417c302fa6f73908bd53e1afbec0d5b13107f34116f77df11de68326",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ae4d4f0f866d28f8d2feb7e68131c1ff61333a6e0288960c12649495f6c44cb7",
        },
        "afcfa626fd95d9b47631b3fe9c7b65ffb0493f8f4c019eeb310c49ceaf08f6de",
    ),
    "ct-int8-cpu": (
        "ka-babd3124e8c4ac99fa631d437cd1577b",
        {
            "config.json": "62884e1ef1749135141fa0abebd3f988166915e6553b6b0c974d5bef0fdef379",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "6f0fe3c35dd2a4561e509f9b9c6b4ce79d22e21c1b7219aae7da4a340ca16501",
        },
        "c034ad424c053ffbb3f3749f328c5e231c5000f393569267590f69f88c917dff",
    ),
    "ct-w8a16-sm90": (
        "ka-9ac5bf64944494233d710f08f4b08292",
        {
            "config.json": "df30a7701861bfb49596b1b22d9dba5e5d10bc20ae37e4f68a9aaa3687e9ea4b",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "c1c34b84965ec46ae617135477557988d1306ae9fab0a875eeab316ce3763e47",
        },
        "1e5ced8e3bcfd244ed5aa3a464e0ad6f2b6ee57f1b6ce1b9ba858c89cf746def",
    ),
    "fp8-block-sm89": (
        "ka-1f03b4610a197951626db55b83825a96",
        {
            "config.json": "28bc8f7d504890ade2ab9de1a3e0f1af700c26e7b0ca73caefe444b496a39218",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "88654309bd0df33fd364b4687d43721cc410323f83bd8a6d708feb17cf11d932",
        },
        "74803fddb6b2698dd3e3786d8b8be49261f155cd81590dbea5807d1517f4d018",
    ),
    "fp8-tensor-cpu": (
        "ka-cf6bc2915d96bdbcbb8b11193e0aa2f3",
        {
            "config.json": "10e7438fb4fe2c4e070bb62892b9c4f33d65fa1a0554d1ad46236e3311bf7f60",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "735bff3b14f77cfcb700d1317b2ba7b4c341776b2332aeb4d0f8505e80c0eb0d",
        },
        "6d30f5225a4f1e38d4612f92da4791bb2cdcf454dfe01ab2d1cb2bd8e163bad5",
    ),
    "fp8-tensor-sm80": (
        "ka-e561b5f87b4a3964aabe0b728e513f32",
        {
            "config.json": "10e7438fb4fe2c4e070bb62892b9c4f33d65fa1a0554d1ad46236e3311bf7f60",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "ef331ab737201ee823a3916d9ec31cac4a8c35b73407ee78149a702b23eeb79f",
        },
        "f6cae5d8c19dad7958d251736f174426b970191c6ab57b40060f326d32de1326",
    ),
    "gptq-actorder-sm80": (
        "ka-e21dc81747e695d2a70161e106ca4973",
        {
            "config.json": "5c349bb7580da9401f7d14c1c08110afaa1f031cd37fee84058420d3b42a1496",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "97efe509531b44176bb120c250e281dc33564f906c79f73f77636e9ef374cc75",
        },
        "e86b2c08b51184b76d59be3df62ebe371831d7ae1930c36d7afae5c7759322d6",
    ),
    "gptq-asym-sm75": (
        "ka-f913c5e1ab2bcdde8e6680644b4a38e2",
        {
            "config.json": "46d5d07e924a4c0bf4f0f87fbf025c64d0d800715fa334d720557a75f1cf0bda",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "0fc2208fc2692348a4b76ab08a441e9563cedde0d78c241164735bbaecb6440b",
        },
        "e0044b003dbb13c6401d1f72823b24f2fb6fed5bcd4380543a1997b466727f82",
    ),
    "gptq-asym-sm80-tp2": (
        "ka-f905036883f7bb84f9bc340493624590",
        {
            "config.json": "83fa8b7f4951f46f2898cd394be47b88b243f3e15216aab4d1d90bdcf7ffd728",
            "generation_config.json": "610a792707d2c3418ab43ee5b2aa4a33c13ab2cc7a1070307e4f52f7e96ad49d",
            "rank0.safetensors": "67d852d990fc557d5fb0121315ad6c38f5d9cc8caff0323513ac9e23a0ae7730",
            "rank1.safetensors": "1e87616a71da745e4da9a90701d652a3b386f8f50102ddfb1cf7c433668b522e",
        },
        "ed3fb814d2cc40c01f7fa1ac3a0406ad403a75fc307b1d5f975e43b82692d32b",
    ),
}


def _manifest_digest(raw: bytes) -> str:
    doc = json.loads(raw)
    for key in VOLATILE:
        doc[key] = ""
    doc["verification"]["seconds"] = 0.0
    doc["source"]["uri"] = ""
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
