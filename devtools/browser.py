"""Headless Chromium, driven by Selenium through Debian's chromedriver (never a browser or driver
download): the console's browser tests and `bench/load.py --console` use it. `chromium()` raises
BrowserUnavailable, with the reason, when the browser, the driver or selenium is missing."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver",)
WINDOW = (1500, 1000)
WAIT_S = 60.0


class BrowserUnavailable(RuntimeError):
    """Chromium, chromedriver or selenium is not installed here."""


def _which(names: tuple[str, ...]) -> str | None:
    return next((p for n in names if (p := shutil.which(n))), None)


@contextmanager
def chromium(profile_dir: Path) -> Iterator[Any]:
    """A headless Chromium session (selenium WebDriver) with its profile in `profile_dir`."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        raise BrowserUnavailable("selenium is not installed (make install installs it)") from e
    browser, driver = _which(CHROMIUM_NAMES), _which(DRIVER_NAMES)
    if browser is None or driver is None:
        raise BrowserUnavailable(
            "headless Chromium needs Debian's chromium and chromium-driver (make test installs them)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--user-data-dir={profile_dir}",
        "--no-first-run", "--disable-extensions", "--disable-background-networking",
    ):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    env = {**os.environ, "SE_OFFLINE": "true"}  # never let Selenium Manager fetch anything
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver, env=env))
    session.set_page_load_timeout(WAIT_S)
    try:
        yield session
    finally:
        session.quit()


def wait_until(session: Any, condition: Callable[[Any], Any], what: str, timeout: float = WAIT_S) -> Any:
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(session, timeout, poll_frequency=0.1).until(condition)
    except TimeoutException:
        raise AssertionError(f"browser: {what} not within {timeout:.0f} s on {session.current_url}") from None


def console_errors(session: Any) -> list[str]:
    """What the page logged as errors (CSP violations included)."""
    return [e["message"] for e in session.get_log("browser") if e["level"] == "SEVERE"]


def enter_console_token(session: Any, token: str) -> None:
    """Type an API token into the console's token form, as an operator does."""
    from selenium.webdriver.common.by import By

    session.find_element(By.ID, "token-input").send_keys(token)
    session.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait_until(session, lambda d: d.find_element(By.ID, "token-held").is_displayed(), "the token to be taken")
