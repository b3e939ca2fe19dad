"""The console over HTTP (no browser): pages carry no data and the security headers, fragments need
a token and keep the API's tenancy, user strings render as text, the artifact checksum is the
manifest's, and the views build the plan grid and the artifact matrix from the API's records."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from services.api.app import create_app
from services.api.console import views
from services.api.console.security import CONTENT_SECURITY_POLICY
from services.db import migrate
from services.settings import ServiceSettings
from tests.services.conftest import create_token, wait_for_job

XSS = "<script>alert(1)</script>"


@pytest.fixture
def embedded(tmp_path: Path, serve_app: Callable[..., str]) -> Iterator[tuple[ServiceSettings, str]]:
    """The embedded API (SQLite, local store, worker threads) on loopback."""
    settings = ServiceSettings(_env_file=None, data_dir=tmp_path / "var", environment="development")  # type: ignore[call-arg]
    migrate.upgrade(settings.resolved_database_url)
    yield settings, serve_app(create_app(settings))


def client(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=60)


def test_pages_are_data_free_shells_with_a_strict_csp(embedded: tuple[ServiceSettings, str]) -> None:
    _, url = embedded
    with client(url, None) as c:
        for path in (
            "/console",
            "/console/new",
            "/console/artifacts",
            "/console/jobs/job-0",
            "/console/artifacts/ka-0",
        ):
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
            assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert (
                "script-src 'self'" in CONTENT_SECURITY_POLICY
                and "unsafe-inline" not in CONTENT_SECURITY_POLICY
            )
            assert r.headers["x-frame-options"] == "DENY" and r.headers["referrer-policy"] == "no-referrer"
            assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), f"{path}: an inline script"
            assert not re.search(r"<[^>]+\son[a-z]+=", r.text), f"{path}: an inline event handler"
            assert "style=" not in r.text
        static = c.get("/console/static/console.js")
        assert static.status_code == 200 and "sessionStorage" in static.text
        assert "localStorage" not in static.text and "document.cookie" not in static.text
        assert c.get("/console/jobs/..%2Fetc").status_code in (404, 422)


def test_fragments_need_a_token_and_keep_tenancy(
    embedded: tuple[ServiceSettings, str], tiny_checkpoint: Path
) -> None:
    settings, url = embedded
    alice, bob = create_token(settings, name="alice"), create_token(settings, name="bob")
    with client(url, None) as anon:
        for path in (
            "/console/fragments/jobs",
            "/console/fragments/artifacts",
            "/console/fragments/jobs/job-1",
        ):
            assert anon.get(path).status_code == 401, path
        health = anon.get("/console/fragments/health")
        assert health.status_code == 200 and 'data-health="ok"' in health.text
    with client(url, alice) as a, client(url, bob) as b:
        job = a.post("/v1/conversions", json={"source": str(tiny_checkpoint), "targets": ["cpu"]}).json()
        assert job["id"] in a.get("/console/fragments/jobs").text
        assert job["id"] not in b.get("/console/fragments/jobs").text
        mine = a.get(f"/console/fragments/jobs/{job['id']}")
        assert mine.status_code == 200 and str(tiny_checkpoint) in mine.text
        assert b.get(f"/console/fragments/jobs/{job['id']}").status_code == 404
        wait_for_job(a, job["id"])


def test_user_strings_render_as_text(embedded: tuple[ServiceSettings, str], tmp_path: Path) -> None:
    """A source and the error message quoting it, both holding markup, come back escaped."""
    settings, url = embedded
    token = create_token(settings)
    source = str(tmp_path / f"no-such{XSS}<img/src=x/onerror=alert(2)>")
    with client(url, token) as c:
        r = c.post("/v1/conversions", json={"source": source, "targets": ["cpu"]})
        assert r.status_code == 202, r.text
        job = wait_for_job(c, r.json()["id"])
        assert job["status"] == "failed" and XSS in job["error"]
        for path in ("/console/fragments/jobs", f"/console/fragments/jobs/{job['id']}"):
            html = c.get(path).text
            assert "<script>" not in html and "<img" not in html, path
            assert (
                "&lt;script&gt;alert(1)&lt;/script&gt;" in html
                and "&lt;img/src=x/onerror=alert(2)&gt;" in html
            )
        plan = c.post("/console/fragments/plan", json={"source": source, "targets": ["cpu"]})
        assert plan.status_code == 404 and "<script>" not in plan.text and "&lt;script&gt;" in plan.text


def test_a_finished_job_shows_its_kernels_verification_and_artifact(
    embedded: tuple[ServiceSettings, str], tiny_checkpoint: Path
) -> None:
    settings, url = embedded
    token = create_token(settings)
    with client(url, token) as c:
        plan = c.post(
            "/console/fragments/plan", json={"source": str(tiny_checkpoint), "targets": ["cpu", "sm80"]}
        )
        assert plan.status_code == 200 and 'data-plan="ok"' in plan.text
        assert (
            'data-grid-targets="sm80 cpu"' in plan.text and "model.layers.0.self_attn.qkv_proj" in plan.text
        )
        r = c.post("/v1/conversions", json={"source": str(tiny_checkpoint), "targets": ["cpu"]})
        job = wait_for_job(c, r.json()["id"])
        assert job["status"] == "succeeded", job
        [aid] = job["artifact_ids"]
        detail = c.get(f"/console/fragments/jobs/{job['id']}").text
        assert "data-final" in detail and f"/console/artifacts/{aid}" in detail and "exact" in detail
        listing = c.get("/console/fragments/artifacts", params={"target": "cpu", "source": "TINY-llama"}).text
        uri = c.get(f"/v1/artifacts/{aid}").json()["uri"]
        assert 'data-artifacts="1"' in listing and f"kiln serve {uri}" in listing
        assert f"vllm serve {uri} --load-format kiln" in listing
        assert 'data-artifacts="0"' in c.get("/console/fragments/artifacts", params={"target": "sm90"}).text
        assert 'data-artifacts="0"' in c.get("/console/fragments/artifacts", params={"source": "x%"}).text
        page = c.get(f"/console/fragments/artifacts/{aid}").text
        manifest = c.get(f"/v1/artifacts/{aid}").json()["urls"]["manifest.json"]
        digest = hashlib.sha256(Path(manifest.removeprefix("file://")).read_bytes()).hexdigest()
        assert digest in page and digest[:12] in listing
        assert page.count("download</a>") == len(c.get(f"/v1/artifacts/{aid}").json()["files"]) + 1


# --- views, on JSON as the API returns it ---------------------------------------------------------


def _plan(target: str, layers: list[tuple[str, str, bool]]) -> dict:
    return {
        "target": target, "fallbacks": sum(f for _, _, f in layers), "notes": [f"note {target}"],
        "expected_bytes": {"per_rank": [10], "total": 10},
        "layers": [
            {"layer": name, "kernel": kernel, "fallback": fb, "scheme": "int4",
             "rejections": [{"kernel": "marlin_wna16", "reason": "N % 64 != 0"}] if fb else []}
            for name, kernel, fb in layers
        ],
    }  # fmt: skip


def test_the_plan_grid_has_layers_by_targets_in_target_order() -> None:
    grid = views.grid_from_plans([
        _plan("cpu", [("l0.qkv", "cpu_int4", False), ("l0.o", "cpu_int4", False)]),
        _plan("sm80", [
            ("l0.qkv", "gptq_wna16", True), ("l0.o", "marlin_wna16", False), ("head", "dense", False),
        ]),
    ])  # fmt: skip
    assert grid.targets == ["sm80", "cpu"]
    assert [layer for layer, _ in grid.rows] == ["l0.qkv", "l0.o", "head"]
    qkv = dict(grid.rows)["l0.qkv"]
    assert qkv[0] is not None and qkv[0].fallback and "marlin_wna16: N % 64 != 0" in qkv[0].hover
    assert "fallback" in qkv[0].css and dict(grid.rows)["head"][1] is None
    assert grid.kernels == ["gptq_wna16", "cpu_int4", "marlin_wna16", "dense"]
    assert [s.fallbacks for s in grid.summaries] == [1, 0]
    assert views.kernel_class("cpu_int4") == views.kernel_class("cpu_int4")
    assert (
        len({views.kernel_class(k) for k in ("cpu_int4", "marlin_wna16", "dense", "cpu_fp8", "fp8_w8a16")})
        > 1
    )


def test_the_manifest_grid_carries_verification() -> None:
    manifest = {
        "target": "cpu",
        "layers": {
            "a": {"kernel": "cpu_int8",
                  "verification": {"ok": True, "metric": "exact", "value": 0.0, "bound": 0.0}},
            "b": {"kernel": "dense", "fallback": True, "rejected": [{"kernel": "cpu_int8", "reason": "no"}],
                  "verification": {"ok": False, "metric": "max_rel_err", "value": 0.5, "bound": 0.01}},
        },
        "expert_groups": {"m": {"kernel": "cpu_int4_experts"}},
        "derived": {"d": {"kernel": "mla_absorbed",
                          "verification": {"ok": True, "metric": "exact", "value": 0.0, "bound": 0.0}}},
    }  # fmt: skip
    grid = views.grid_from_manifests([("ka-1", 123, manifest)])
    cells = {layer: c[0] for layer, c in grid.rows}
    assert cells["d"] is not None and cells["d"].kernel == "mla_absorbed"  # MLA's absorbed matrices
    assert cells["a"] is not None and cells["a"].verification == "exact"
    assert cells["b"] is not None and cells["b"].verification.startswith("FAILED max_rel_err 5.00e-01")
    assert cells["m"] is not None and cells["m"].verification == ""
    assert grid.summaries[0].artifact_id == "ka-1" and grid.summaries[0].fallbacks == 1


def test_the_artifact_matrix_and_its_serve_commands() -> None:
    def art(aid: str, model: str, target: str, tp: int = 1, ep: bool = False) -> views.ArtifactView:
        return views.ArtifactView(
            id=aid, model=model, source_uri=f"s3://b/{model}", source_format="gptq", target=target,
            method="auto", tp=tp, expert_parallel=ep, size_bytes=2048, checksum="ab" * 32,
            uri=f"s3://store/{aid}", job_id=None,
        )  # fmt: skip

    matrix = views.artifact_matrix(
        [art("ka-2", "m", "cpu"), art("ka-1", "m", "sm90", 2, True), art("ka-3", "n", "sm80")]
    )
    assert matrix.targets == ["sm80", "sm90", "cpu"]
    assert [model for model, _ in matrix.rows] == ["m", "n"]
    ep = dict(matrix.rows)["m"][1][0]
    assert ep.parallelism == "EP 2" and ep.serve_commands == [
        "kiln serve s3://store/ka-1",
        "vllm serve s3://store/ka-1 --load-format kiln --tensor-parallel-size 2 --enable-expert-parallel",
    ]
    assert views.human_bytes(2048) == "2.0 KiB" and views.human_bytes(None) == "—"
