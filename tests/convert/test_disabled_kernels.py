"""One rule for the kernels a conversion leaves out, wherever the request comes from: the request's
and the deployment's (KILN_DISABLED_KERNELS) together — `kiln plan` / `POST /v1/plans` promise only
kernels the conversion and the worker will use."""

from __future__ import annotations

from pathlib import Path

from devtools.builders.synthetic import write_checkpoint
from kernels.targets import Target
from runtime.artifact.manifest import Manifest
from services.convert.library import ConversionRequest, convert, plan_targets
from services.convert.spec import ConversionSpec, disabled_kernels
from services.settings import ServiceSettings


def test_the_request_and_the_deployment_disable_kernels_together() -> None:
    assert disabled_kernels(["dense", "cpu_int4"], ["cpu_int4", "cpu_int8"]) == (
        "dense",
        "cpu_int4",
        "cpu_int8",
    )
    assert disabled_kernels([], []) == ()


def test_plan_and_conversion_leave_out_both_sets(tmp_path: Path) -> None:
    src = str(write_checkpoint(tmp_path / "src", "gptq", bits=8, group_size=-1))
    settings = ServiceSettings(_env_file=None, data_dir=tmp_path / "var", disabled_kernels=["cpu_int8"])  # type: ignore[call-arg]
    spec = ConversionSpec(source=src, targets=[Target.CPU], options={"disabled_kernels": ["cpu_w8a8"]})
    [planned] = plan_targets(spec, settings=settings)
    kernels = {layer.kernel.name for layer in planned.units}
    assert kernels == {"dense"}  # int8 weights: cpu_int8 (deployment) and cpu_w8a8 (request) left out
    assert all(
        {"cpu_int8", "cpu_w8a8"} <= {name for name, _ in layer.rejected}
        for layer in planned.units
        if layer.quant.scheme == "int"
    )
    request = ConversionRequest.from_spec(spec, out=str(tmp_path / "out"))
    [result] = convert(request, settings=settings)
    assert {entry.kernel for entry in Manifest.load(Path(result.uri)).layers.values()} == {"dense"}
