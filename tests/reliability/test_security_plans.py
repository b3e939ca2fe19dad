"""A checkpoint is untrusted input to `kiln api`: POST /v1/plans reads it in the API process. Over
real HTTP against a `kiln api` subprocess (SQLite, embedded worker):

- its regular expressions (compressed-tensors `re:` entries, GPTQ `dynamic` keys) run under RE2: a
  pattern that backtracks forever under Python's `re` stalls neither /health nor other callers,
  and one RE2 cannot run (lookaround, backreferences) is a 422 naming the field and the pattern;
- its sizes are capped before work starts: a 1 KB config.json claiming a million layers is a quick
  422 naming `num_hidden_layers`, as is any dimension over its cap or beyond the tensors present;
- its errors say nothing of the server's filesystem: a path that is not a checkpoint directory gets
  one 404 whatever the reason, naming no server path but the one submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.builders.synthetic import QWEN3_MOE_TINY, write_checkpoint
from services.convert.limits import (
    CONFIG_JSON_MAX_BYTES,
    DIMENSION_CAPS,
    MAX_CONFIG_PATTERNS,
    MAX_PATTERN_MATCHES,
    CheckpointLimitError,
    check_pattern_work,
)
from services.redact import NO_LOCAL_CHECKPOINT
from tests.reliability.kiln_api import KilnApi, kiln_api
from tests.services.conftest import create_token

# Backtracks exponentially in the length of the name under Python's re: against a ~30-character
# module name it does not finish (and holds the GIL, stopping every thread of the process).
BACKTRACKING = "(?:.*.*)*!"
INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}


def compressed_tensors(ignore: list[str], targets: list[str] | None = None) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ignore,
        "config_groups": {"group_0": {"targets": targets or ["Linear"], "weights": INT4}},
    }


def gptq(dynamic: dict[str, Any]) -> dict[str, Any]:
    return {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "modules_in_block_to_quantize": ["q_proj"], "dynamic": dynamic,
    }  # fmt: skip


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnApi]:
    with kiln_api(tmp_path_factory.mktemp("kiln-api")) as server:
        yield server


@pytest.fixture(scope="module")
def other_tenant(api: KilnApi) -> str:
    return create_token(api.settings(), name="other-tenant")


def variant(base: Path, dest: Path, **config: Any) -> Path:
    """A copy of checkpoint `base` with these config.json fields replaced."""
    shutil.copytree(base, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def plan(api: KilnApi, token: str, source: str | Path, timeout: float = 60) -> httpx.Response:
    return httpx.post(
        f"{api.url}/v1/plans",
        json={"source": str(source), "targets": ["cpu"]},
        headers={"Authorization": f"Bearer {token}"},
        timeout=timeout,
    )


def latency(fn: Any) -> float:
    """Seconds `fn()` took; a timeout or a dropped connection counts as forever."""
    t0 = time.perf_counter()
    try:
        fn()
    except httpx.HTTPError:
        return float("inf")
    return time.perf_counter() - t0


# --- finding 2: regular expressions from the checkpoint ----------------------------------------


@pytest.mark.timing
@pytest.mark.parametrize(
    "quantization",
    [compressed_tensors(ignore=[f"re:{BACKTRACKING}"]), gptq({f"-:{BACKTRACKING}": {}})],
    ids=["compressed-tensors-ignore", "gptq-dynamic"],
)
def test_a_backtracking_pattern_stalls_neither_health_nor_other_tenants(
    api: KilnApi, other_tenant: str, tiny_checkpoint: Path, tmp_path: Path, quantization: dict[str, Any]
) -> None:
    hostile = variant(tiny_checkpoint, tmp_path / "hostile", quantization_config=quantization)
    answer: dict[str, Any] = {}

    def hostile_plan() -> None:
        try:
            answer["response"] = plan(api, api.admin_token, hostile, timeout=120)
        except httpx.HTTPError as e:
            answer["error"] = e

    thread = threading.Thread(target=hostile_plan, daemon=True)
    thread.start()
    health, innocent = [], []
    other = {"Authorization": f"Bearer {other_tenant}"}
    for _ in range(5):
        health.append(latency(lambda: httpx.get(f"{api.url}/health", timeout=10).raise_for_status()))
        innocent.append(
            latency(lambda: plan(api, other_tenant, tiny_checkpoint, timeout=10).raise_for_status())
        )
        innocent.append(
            latency(
                lambda: httpx.get(f"{api.url}/v1/conversions", headers=other, timeout=10).raise_for_status()
            )
        )
    thread.join(timeout=60)
    assert max(health) < 1.0, f"/health took {health} s while the hostile plan ran"
    assert max(innocent) < 10.0, f"another tenant's requests took {innocent} s"
    assert not thread.is_alive(), "the hostile plan did not finish within 60 s"
    r = answer["response"]
    # RE2 runs the pattern (it matches nothing); planning then finds the layer's tensors missing.
    assert r.status_code == 422 and "model.layers.0.self_attn" in r.json()["detail"], r.text


@pytest.mark.parametrize(
    ("quantization", "field", "pattern"),
    [
        (
            compressed_tensors(ignore=["lm_head", "re:(?=model).*q_proj"]),
            "ignore entry 're:(?=model).*q_proj'",
            "(?=",
        ),
        (compressed_tensors(ignore=[], targets=[r"re:(\w+)\.\1"]), "config_groups.group_0.targets", r"\1"),
        (gptq({r"+:.*(?<!k)_proj": {"bits": 8}}), "dynamic rule '+:.*(?<!k)_proj'", "(?<"),
    ],
    ids=["lookahead", "backreference", "lookbehind"],
)
def test_a_pattern_re2_cannot_run_is_a_422_naming_field_and_pattern(
    api: KilnApi,
    tiny_checkpoint: Path,
    tmp_path: Path,
    quantization: dict[str, Any],
    field: str,
    pattern: str,
) -> None:
    src = variant(tiny_checkpoint, tmp_path / "src", quantization_config=quantization)
    r = plan(api, api.admin_token, src)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert field in detail and pattern in detail and "RE2" in detail and "lookaround" in detail, detail


def test_too_many_patterns_are_refused_naming_the_cap(
    api: KilnApi, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    many = [f"re:model\\.layers\\.{i}\\.mlp" for i in range(MAX_CONFIG_PATTERNS + 1)]
    src = variant(tiny_checkpoint, tmp_path / "src", quantization_config=compressed_tensors(ignore=many))
    r = plan(api, api.admin_token, src)
    assert r.status_code == 422 and f"more than {MAX_CONFIG_PATTERNS} regular expressions" in r.text, r.text


# --- finding 3: sizes a checkpoint controls ----------------------------------------------------


@pytest.mark.timing
def test_a_config_claiming_a_million_layers_is_refused_at_once(
    api: KilnApi, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    src = variant(tiny_checkpoint, tmp_path / "src", num_hidden_layers=1e6)
    assert (src / "config.json").stat().st_size < 1024
    t0 = time.perf_counter()
    r = plan(api, api.admin_token, src)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "num_hidden_layers = 1000000" in detail and "2 layers" in detail, detail
    assert elapsed < 2.0, f"refusing took {elapsed:.2f} s"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_hidden_layers": 10**9}, f"num_hidden_layers = {10**9}, but the checkpoint's safetensors"),
        ({"hidden_size": 4096}, "hidden_size = 4096, but the checkpoint's hidden states are 256 wide"),
        ({"vocab_size": 10**6}, "vocab_size = 1000000, but the embedding and lm_head hold 512 rows"),
        ({"intermediate_size": 10**6}, "intermediate_size = 1000000, but MLPs that size"),
        ({"num_attention_heads": 10**4}, f"but Kiln caps it at {DIMENSION_CAPS['num_attention_heads']}"),
        ({"num_attention_heads": float("inf")}, "num_attention_heads = inf; it must be a positive integer"),
    ],
    ids=["layers", "hidden", "vocab", "intermediate", "heads-cap", "heads-infinite"],
)
def test_dimensions_beyond_their_cap_or_the_tensors_are_refused_naming_the_field(
    api: KilnApi, tiny_checkpoint: Path, tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    src = variant(tiny_checkpoint, tmp_path / "src", **change)
    r = plan(api, api.admin_token, src)
    assert r.status_code == 422 and says in r.json()["detail"], r.text


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_experts": 10**5}, f"num_experts = {10**5}, but Kiln caps it at"),
        (
            {"moe_intermediate_size": 1 << 17},
            f"moe_intermediate_size = {1 << 17}, but MLPs that size (per expert",
        ),
    ],
    ids=["experts-cap", "moe-intermediate"],
)
def test_moe_dimensions_are_checked_too(
    api: KilnApi, tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    base = write_checkpoint(tmp_path / "moe", "dense", dims=QWEN3_MOE_TINY, dtype="bfloat16")
    assert plan(api, api.admin_token, base).status_code == 200
    src = variant(base, tmp_path / "src", **change)
    r = plan(api, api.admin_token, src)
    assert r.status_code == 422 and says in r.json()["detail"], r.text


def test_a_config_json_over_its_byte_cap_is_refused_before_parsing(
    api: KilnApi, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    src = variant(tiny_checkpoint, tmp_path / "src", padding="x" * CONFIG_JSON_MAX_BYTES)
    r = plan(api, api.admin_token, src)
    assert r.status_code == 422, r.text
    assert f"over Kiln's {CONFIG_JSON_MAX_BYTES}-byte limit" in r.json()["detail"]
    assert "config.json" in r.json()["detail"]


# --- finding 4: no filesystem oracle, no server paths --------------------------------------------


def _not_checkpoints(tmp_path: Path) -> list[str]:
    (tmp_path / "to-passwd").symlink_to("/etc/passwd")
    outside = tmp_path / "config-out"
    outside.mkdir()
    (outside / "config.json").symlink_to("/etc/passwd")
    (outside / "model.safetensors").write_bytes(b"")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    (tmp_path / "a-file").write_text("x")
    return [
        str(tmp_path / "missing"),
        str(tmp_path / "to-passwd"),
        str(outside),
        str(locked),  # unreadable to a non-root server
        "/proc/1/cwd",  # unreadable to every process but PID 1's owner with ptrace rights
        str(tmp_path / "a-file"),
        "/proc/self/cwd",  # the server's working directory
        "/etc",
    ]


def test_paths_that_are_not_checkpoints_are_one_404_naming_no_server_path(
    api: KilnApi, tmp_path: Path
) -> None:
    sources = _not_checkpoints(tmp_path)
    try:
        answers = {src: plan(api, api.admin_token, src) for src in sources}
    finally:
        (tmp_path / "locked").chmod(0o700)
    server_cwd = os.readlink(f"/proc/{api.proc.pid}/cwd")
    for src, r in answers.items():
        assert r.status_code == 404, (src, r.text)
        assert r.json() == {"detail": f"source {src!r}: {NO_LOCAL_CHECKPOINT}"}, (src, r.text)
        assert server_cwd not in r.text.replace(src, ""), (src, r.text)


def test_plan_errors_on_a_real_checkpoint_name_no_other_server_path(
    api: KilnApi, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """A checkpoint whose tokenizer file is a symlink out of it: the 422 says so without the target."""
    src = variant(tiny_checkpoint, tmp_path / "ckpt")
    secret = tmp_path / "elsewhere" / "server-secret.json"
    secret.parent.mkdir()
    secret.write_text("{}")
    (src / "tokenizer.json").unlink(missing_ok=True)
    (src / "tokenizer.json").symlink_to(secret)
    via_proc = f"/proc/self/root{src}"
    r = plan(api, api.admin_token, via_proc)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "outside the checkpoint directory" in detail and via_proc in detail, detail
    assert "elsewhere" not in detail and str(src) not in detail.replace(via_proc, ""), detail


def test_patterns_times_modules_are_capped() -> None:
    """Each module name may be tried against every pattern: the product is bounded (a 256-pattern
    config over an MoE of 10,000 expert projections would be 2.56 million matches)."""
    check_pattern_work("GPTQ", MAX_CONFIG_PATTERNS, MAX_PATTERN_MATCHES // MAX_CONFIG_PATTERNS)
    with pytest.raises(CheckpointLimitError, match="256 regular expressions against the model's 10000"):
        check_pattern_work("GPTQ", 256, 10_000)
