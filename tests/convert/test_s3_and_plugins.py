"""S3 sources and outputs through a real S3-protocol server, the `kiln.formats` plugin group, and the CLI."""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from devtools.builders.synthetic import llama_config
from runtime.artifact.manifest import Manifest
from services.cli import app
from services.convert.library import ConversionRequest, convert, plan
from services.settings import ServiceSettings as Settings
from services.storage import open_store
from services.storage.s3 import S3Store


def _upload(store: S3Store, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.client.upload_file(
                str(path), store.bucket, f"{prefix}/{path.relative_to(local).as_posix()}"
            )


def test_s3_source_to_s3_artifacts(ckpt: Callable[[str], Path], s3_bucket: str) -> None:
    settings = Settings(s3_multipart_chunk_mb=5)
    store = open_store(f"s3://{s3_bucket}/artifacts", settings)
    assert isinstance(store, S3Store)
    _upload(store, ckpt("gptq-w4-v2-asym"), "checkpoints/tiny-gptq")
    source = f"s3://{s3_bucket}/checkpoints/tiny-gptq"

    p = plan(source, "sm80", tp=2, settings=settings)
    assert {r.kernel for r in p.rows if r.layer != "lm_head"} == {"marlin_wna16"}

    req = ConversionRequest(source, ["sm80", "cpu"], tp=2, out=f"s3://{s3_bucket}/artifacts")
    results = convert(req, settings=settings)
    assert [r.uri for r in results] == [f"s3://{s3_bucket}/artifacts/{r.artifact_id}" for r in results]
    assert store.list_ids() == sorted(r.artifact_id for r in results)
    assert store.staging_keys() == []
    for r in results:
        m = Manifest.parse(store.read_manifest(r.artifact_id))
        assert m == r.manifest and m.verification.ok and m.source.uri == source
        urls = store.presigned_urls(r.artifact_id)
        rank1 = next(f for f in m.files if f.name == "rank1.safetensors")
        with urllib.request.urlopen(urls[rank1.name], timeout=30) as resp:
            assert hashlib.sha256(resp.read()).hexdigest() == rank1.sha256

    # the same checkpoint converted from a local directory has the same source digest -> same ids
    again = convert(
        ConversionRequest(str(ckpt("gptq-w4-v2-asym")), ["sm80", "cpu"], tp=2, out=req.out), settings=settings
    )
    assert [r.artifact_id for r in again] == [r.artifact_id for r in results]
    assert all(r.reused for r in again)


PLUGIN = textwrap.dedent(
    '''
    """A toy out-of-tree format: dense weights stored transposed as `weight_t` (K, N)."""
    from kernels.base import DenseWeight
    from services.convert.formats.base import DENSE, CheckpointFormat


    class TransposedFormat(CheckpointFormat):
        name = "kiln-test-transposed"

        @classmethod
        def detect(cls, ckpt, quantization, where):
            if (quantization or {}).get("quant_method") == "kiln-test-transposed":
                return cls(ckpt, quantization)
            return None

        def layer_quant(self, module, layout):
            return DENSE

        def weight_suffixes(self, lq):
            return ("weight_t",)

        def decode(self, module, lq, tensors):
            return DenseWeight(tensors[module + ".weight_t"].T.contiguous(), tensors.get(module + ".bias"))
    '''
)


@pytest.fixture
def plugin_on_path(tmp_path: Path) -> Iterator[Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "kiln_test_format.py").write_text(PLUGIN)
    dist = site / "kiln_test_format-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kiln-test-format\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[kiln.formats]\ntransposed = kiln_test_format:TransposedFormat\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("kiln_test_format", None)
        importlib.invalidate_caches()


def test_out_of_tree_format_plugin(plugin_on_path: Path, ckpt: Callable[[str], Path], tmp_path: Path) -> None:
    from safetensors import safe_open

    src = ckpt("bf16")
    path = tmp_path / "transposed"
    path.mkdir()
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    moved = {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            moved[name[: -len("weight")] + "weight_t"] = t.T.contiguous()
        else:
            moved[name] = t
    save_file(moved, str(path / "model.safetensors"))
    cfg = llama_config(__import__("devtools.builders.synthetic", fromlist=["TINY"]).TINY, "bfloat16",
                       {"quant_method": "kiln-test-transposed"})  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))

    p = plan(str(path), "cpu")
    assert p.format == "kiln-test-transposed"
    (r,) = convert(ConversionRequest(str(path), ["cpu"], out=str(tmp_path / "out")))
    (ref,) = convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "ref")))
    assert r.manifest.source.format == "kiln-test-transposed" and r.manifest.verification.ok
    with (
        safe_open(str(Path(r.uri) / "rank0.safetensors"), framework="pt") as a,
        safe_open(str(Path(ref.uri) / "rank0.safetensors"), framework="pt") as b,
    ):
        name = "model.layers.0.mlp.gate_up_proj.weight"
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))


runner = CliRunner()


def test_cli_plan_json_and_table(ckpt: Callable[[str], Path]) -> None:
    res = runner.invoke(app, ["plan", str(ckpt("gptq-w4-v1-sym")), "--target", "sm80", "--tp", "2", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["target"] == "sm80" and data["tp"] == 2
    assert {row["kernel"] for row in data["layers"]} == {"marlin_wna16", "dense"}
    table = runner.invoke(app, ["plan", str(ckpt("gptq-w4-v1-sym")), "--target", "sm80,cpu"])
    assert table.exit_code == 0 and "marlin_wna16" in table.stdout and "cpu_int4" in table.stdout


def test_cli_convert_and_failures(ckpt: Callable[[str], Path], tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["convert", str(ckpt("bf16")), "--target", "cpu", "--out", str(tmp_path), "--json"]
    )
    assert res.exit_code == 0, res.output
    (art,) = json.loads(res.stdout)
    assert (tmp_path / art["artifact_id"] / "manifest.json").is_file() and art["verification"]["ok"]
    table = runner.invoke(app, ["convert", str(ckpt("bf16")), "--target", "cpu", "--out", str(tmp_path)])
    assert table.exit_code == 0 and "reused" in table.stdout

    bad = runner.invoke(app, ["convert", str(ckpt("gptq-w4-v1-sym")), "--target", "sm90", "--method", "fp8",
                              "--out", str(tmp_path / "x")])  # fmt: skip
    assert bad.exit_code == 1
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "already quantized" in lines[0]
    assert "Traceback" not in bad.output
    assert not (tmp_path / "x").exists() or not any(p.name != ".staging" for p in (tmp_path / "x").iterdir())
