"""A conversion request has one shape (services/convert/spec.py): the REST body is it, a job row
stores it as JSON and the worker validates it back — rows written before any option existed
included; the CLI and the library get a KilnError naming a bad value."""

from __future__ import annotations

import pytest

from kernels.targets import Target
from services.api.schemas import ConversionCreate
from services.convert.spec import ConversionSpec, ConversionSpecError, conversion_spec
from services.db import repo
from services.db.models import Job
from services.worker.jobs import stored_spec


def test_the_rest_body_is_the_spec_and_a_row_round_trips() -> None:
    body = ConversionCreate.model_validate(
        {
            "source": "/models/x",
            "targets": ["sm80", "cpu", "cpu"],
            "tp": 2,
            "options": {"fp8_scheme": "block"},
        }
    )
    assert isinstance(body, ConversionSpec)
    row = body.row()
    assert row["targets"] == ["cpu", "sm80"]
    job = Job(**repo.spec_columns(body))
    assert (job.spec, job.source) == (row, "/models/x")
    assert stored_spec(job) == ConversionSpec.model_validate(row)
    assert stored_spec(job).options.fp8_scheme == "block"


def test_an_old_row_without_options_runs_with_the_defaults() -> None:
    job = Job(spec={"source": "/models/x", "targets": ["cpu"], "method": "auto", "tp": 1, "options": {}})
    spec = stored_spec(job)
    assert spec.targets == [Target.CPU]
    assert (spec.options.fp8_scheme, spec.options.disabled_kernels, spec.options.expert_parallel) == (
        "tensor",
        [],
        False,
    )


def test_a_bad_value_is_a_kiln_error_naming_the_field() -> None:
    method = r"method 'int3' is not supported: Input should be 'auto' or 'fp8'"
    with pytest.raises(ConversionSpecError, match=method):
        conversion_spec(source="/m", targets=[Target.CPU], method="int3")
    with pytest.raises(ConversionSpecError, match=r"options\.fp8_scheme 'row' is not supported"):
        conversion_spec(source="/m", targets=[Target.CPU], options={"fp8_scheme": "row"})
    tp = r"tp 65 is not supported: Input should be less than or equal to 64"
    with pytest.raises(ConversionSpecError, match=tp):
        conversion_spec(source="/m", targets=[Target.CPU], tp=65)
