"""Selenium with Debian's chromium + chromium-driver, for the console's browser tests and the
screenshot tool. ``missing()`` says what is absent (and how to install it) instead of failing."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

INSTALL = "as root: apt-get install -y chromium chromium-driver (`make test` does this when it can)"
TIMEOUT = 60.0  # the longest a DOM condition may take before the test fails (shared, loaded CI machines)


def _find(exe: str) -> str | None:
    found = shutil.which(exe)
    if found is None and Path(f"/usr/bin/{exe}").exists():
        found = f"/usr/bin/{exe}"
    return found


def missing() -> str | None:
    """Why a browser cannot be started here (None: it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[test]'"
    absent = [f"{exe} (Debian package {pkg})" for exe, pkg in (("chromium", "chromium"),
                                                               ("chromedriver", "chromium-driver"))
              if _find(exe) is None]
    return f"not found: {', '.join(absent)}; install them {INSTALL}" if absent else None


def start_chromium(downloads: Path, *, width: int = 1440, height: int = 1000) -> Any:
    """A headless Chromium driven through chromedriver (both Debian's)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(_find("chromium"))
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--hide-scrollbars", f"--window-size={width},{height}",
                "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                           "download.prompt_for_download": False})
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(_find("chromedriver"))), options=opts)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    return driver


def wait(driver: Any, condition: Callable[[Any], Any], timeout: float = TIMEOUT) -> Any:
    """Wait on a DOM condition (never a sleep); missing elements count as 'not yet'."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, ignored_exceptions=(NoSuchElementException,
                                                              StaleElementReferenceException)).until(condition)


def view(driver: Any, name: str) -> Any:
    """The current page's root once its data has loaded."""
    from selenium.webdriver.common.by import By

    return wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, f'.view[data-view="{name}"][data-ready="1"]'))


def sign_in(driver: Any, token: str) -> None:
    from selenium.webdriver.common.by import By

    field = wait(driver, lambda d: d.find_element(By.ID, "token") if d.find_element(By.ID, "signin").is_displayed()
                 else None)
    field.send_keys(token)
    driver.find_element(By.ID, "signin-button").click()
    wait(driver, lambda d: d.find_element(By.ID, "view").is_displayed())


def js_errors(driver: Any) -> list[str]:
    """Script errors and CSP violations logged by the page (failed requests the page handles are not)."""
    return [e["message"] for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]
