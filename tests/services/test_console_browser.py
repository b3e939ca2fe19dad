"""The console in a real browser (headless Chromium, devtools/browser.py) against the API the
test starts: enter a token, plan and submit a conversion from the form, watch it finish, open its
plan and its artifact, find it in the artifact matrix; markup in a source and an error renders as
text. A screenshot of each page lands in the test's directory (or $KILN_CONSOLE_SCREENSHOTS)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools import browser
from devtools.browser import console_errors, enter_console_token, wait_until
from services.settings import ServiceSettings
from tests.services.conftest import create_token, wait_for_job
from tests.services.test_console import embedded  # noqa: F401  (fixture)

pytestmark = pytest.mark.timing  # rerun under a CPU hog by bench/flaky.py
JOB_DONE_S = 180.0
JOB_STATUS_JS = "const e = document.querySelector('#job [data-status]'); return e ? e.dataset.status : null;"


@pytest.fixture(scope="module")
def tiny_gptq(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic tiny GPTQ int4 Llama: Marlin on sm80, the CPU int4 kernel on cpu."""
    from devtools.builders.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("console") / "tiny-gptq", "gptq")


def screenshots(tmp_path: Path) -> Callable[[Any, str], Path]:
    out = Path(os.environ.get("KILN_CONSOLE_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)

    def shot(session: Any, name: str) -> Path:
        path = out / f"{name}.png"
        session.save_screenshot(str(path))
        return path

    return shot


def page_errors(session: Any) -> list[str]:
    return console_errors(session)  # the pages name their icon: no favicon.ico 404 either


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """Headless Chromium, or the test skipped with the reason it is unavailable."""
    try:
        with browser.chromium(profile) as session:
            yield session
    except browser.BrowserUnavailable as e:
        pytest.skip(str(e))


def test_a_conversion_from_the_form_to_its_artifact(
    embedded: tuple[ServiceSettings, str],  # noqa: F811
    tiny_gptq: Path,
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    settings, url = embedded
    token = create_token(settings)
    shot = screenshots(tmp_path)
    with chromium(tmp_path / "profile") as b:
        b.get(f"{url}/console/new")
        wait_until(b, lambda d: d.find_elements(By.CSS_SELECTOR, "#health [data-health=ok]"), "health")
        enter_console_token(b, token)
        b.find_element(By.NAME, "source").send_keys(str(tiny_gptq))
        b.find_element(By.CSS_SELECTOR, "input[name=targets][value=sm80]").click()  # cpu is preset
        assert not b.find_element(By.ID, "submit-conversion").is_enabled()  # the plan comes first
        b.find_element(By.ID, "show-plan").click()
        grid = wait_until(
            b, lambda d: d.find_elements(By.CSS_SELECTOR, "#plan [data-plan=ok] table.grid"), "the plan grid"
        )[0]
        heads = [th.text for th in grid.find_elements(By.CSS_SELECTOR, "thead th")]
        assert heads == ["Layer", "sm80", "cpu"]
        kernels = {td.get_attribute("data-kernel") for td in grid.find_elements(By.CSS_SELECTOR, "td.kernel")}
        assert "marlin_wna16" in kernels and None not in kernels
        shot(b, "1-new-conversion-with-plan")

        b.find_element(By.ID, "submit-conversion").click()
        wait_until(b, lambda d: "/console/jobs/job-" in d.current_url, "the job page after submitting")
        job_id = b.current_url.rsplit("/", 1)[-1]
        # Read in one script call: the page replaces the fragment every 2 s, so an element found in
        # one WebDriver call can be gone (stale) by the next.
        seen: set[str | None] = set()
        wait_until(
            b,
            lambda d: seen.add(d.execute_script(JOB_STATUS_JS)) or "succeeded" in seen,
            "the job to succeed (the page refreshes itself)",
            JOB_DONE_S,
        )
        verdicts = [v.text for v in b.find_elements(By.CSS_SELECTOR, "#job table.grid .verify")]
        assert verdicts and all(v == "exact" or v.startswith("max_") for v in verdicts), verdicts
        links = b.find_elements(By.CSS_SELECTOR, "#job table.targets a[href^='/console/artifacts/']")
        assert len(links) == 2
        shot(b, "2-job-finished-with-plan-grid")

        links[-1].click()  # the cpu artifact (targets in list order: sm80, cpu)
        wait_until(
            b, lambda d: d.find_elements(By.CSS_SELECTOR, "#artifact [data-artifact]"), "the artifact page"
        )
        artifact_id = b.current_url.rsplit("/", 1)[-1]
        downloads = b.find_elements(By.CSS_SELECTOR, "#artifact table.files a[download]")
        assert downloads and all(a.get_attribute("href").startswith("file://") for a in downloads)
        assert "kiln serve" in b.find_element(By.ID, "artifact").text
        shot(b, "3-artifact")

        b.get(f"{url}/console/artifacts")
        Select(b.find_element(By.NAME, "target")).select_by_value("cpu")
        wait_until(
            b,
            lambda d: (
                d.find_elements(By.CSS_SELECTOR, f"#artifacts [data-artifact='{artifact_id}']")
                and not d.find_elements(By.CSS_SELECTOR, "#artifacts th:nth-child(2):not(:last-child)")
            ),
            "the cpu artifact, filtered",
        )
        shot(b, "4-artifacts-matrix")

        b.get(f"{url}/console")
        row = f"#jobs tr[data-job='{job_id}'][data-status=succeeded]"
        wait_until(b, lambda d: d.find_elements(By.CSS_SELECTOR, row), "the job in the list")
        shot(b, "5-jobs")
        assert b.get_cookies() == [] and token not in b.current_url
        assert b.execute_script("return document.cookie") == ""
        assert page_errors(b) == []


def test_markup_in_a_source_and_an_error_renders_as_text_in_the_browser(
    embedded: tuple[ServiceSettings, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    settings, url = embedded
    token = create_token(settings)
    source = str(tmp_path / "m<script>window.kilnXss=1</script><img/src=x/onerror=window.kilnXss=2>")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        job = wait_for_job(
            c, c.post("/v1/conversions", json={"source": source, "targets": ["cpu"]}).json()["id"]
        )
    assert job["status"] == "failed" and "<script>" in job["error"]
    with chromium(tmp_path / "profile") as b:
        b.get(f"{url}/console/jobs/{job['id']}")
        enter_console_token(b, token)
        wait_until(
            b, lambda d: d.find_elements(By.CSS_SELECTOR, "#job [data-status=failed]"), "the failed job"
        )
        shot = screenshots(tmp_path)
        shot(b, "xss-job")
        text = b.find_element(By.ID, "job").text
        assert "<script>window.kilnXss=1</script>" in text and "<img/src=x/onerror=window.kilnXss=2>" in text
        assert not b.find_elements(By.CSS_SELECTOR, "#job script, #job img")
        b.get(f"{url}/console")
        wait_until(
            b, lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job['id']}']"), "the list"
        )
        assert "<script>window.kilnXss=1</script>" in b.find_element(By.ID, "jobs").text
        assert b.execute_script("return window.kilnXss === undefined")
        assert page_errors(b) == []
