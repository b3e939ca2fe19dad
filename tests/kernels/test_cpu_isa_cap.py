"""`KILN_CPU_ISA`: one machine runs the path of a narrower x86 CPU — the flags Kiln reads, both native
libraries' bodies and torch's / oneDNN's caps for a child process — and a bad value is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_features
from kernels.errors import KilnError

REPO = Path(__file__).resolve().parents[2]
# what a child reports: the flags Kiln uses, both libraries' bodies, torch's capability
PROBE = """
import json, torch
from kernels import cpu_features, cpu_w4a8
from runtime.native_decode import LIBRARY
step, w4a8 = LIBRARY.get(), cpu_w4a8.LIBRARY.get()
print(json.dumps({
    "bf16": cpu_features.has_native_bf16(), "int8_dot": cpu_features.has_int8_dot_products(),
    "avx512": any(f.startswith("avx512") for f in cpu_features.cpu_flags()),
    "step": None if step is None else step.kiln_set_isa(-1),
    "w4a8": None if w4a8 is None else w4a8.kiln_w4a8_level(-1),
    "torch": torch.backends.cpu.get_cpu_capability(),
}))
"""


def _probe(cap: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    env |= cpu_features.isa_environment(cap) | {"PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_avx2_cap_leaves_out_every_wider_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    flags = cpu_features.cpu_flags()
    assert not any(f.startswith(("avx512", "amx", "avx_vnni")) for f in flags)
    assert not cpu_features.has_native_bf16() and not cpu_features.has_int8_dot_products()
    assert ("avx2" in flags) == ("avx2" in cpu_features.machine_flags())
    assert cpu_features.isa_level() == cpu_features.ISA_CAPS.index("avx2")
    monkeypatch.setenv(cpu_features.ISA_ENV, "scalar")
    assert "avx2" not in cpu_features.cpu_flags() and "fma" not in cpu_features.cpu_flags()


def test_auto_is_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_features.ISA_ENV, raising=False)
    assert cpu_features.cpu_flags() == cpu_features.machine_flags()
    assert cpu_features.isa_level() == len(cpu_features.ISA_CAPS) - 1
    assert cpu_features.isa_environment("auto") == {}


def test_a_bad_cap_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx1024")
    with pytest.raises(KilnError, match="KILN_CPU_ISA='avx1024' is not one of auto, scalar, avx2, avx512"):
        cpu_features.cpu_flags()
    with pytest.raises(KilnError, match="no CPU cap 'avx1024'"):
        cpu_features.isa_environment("avx1024")


def test_a_capped_process_runs_the_avx2_bodies_and_torch_at_avx2() -> None:
    if "avx2" not in cpu_features.machine_flags():
        pytest.skip("this CPU has no AVX2")
    capped = _probe("avx2")
    assert capped["bf16"] is False and capped["int8_dot"] is False and capped["avx512"] is False
    assert capped["torch"] == "AVX2"
    avx2 = cpu_features.ISA_CAPS.index("avx2")
    for lib in ("step", "w4a8"):  # None: no C compiler here (the torch path runs)
        assert capped[lib] in (None, avx2), capped


def test_the_scalar_cap_reaches_both_libraries() -> None:
    capped = _probe("scalar")
    assert capped["torch"] == "DEFAULT"
    for lib in ("step", "w4a8"):
        assert capped[lib] in (None, 0), capped
