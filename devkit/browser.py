"""A real headless browser for tests of the status page: Debian's chromium
and chromedriver (apt's `chromium chromium-driver`, by path: Selenium
Manager downloads nothing), driven through selenium, with the console and
the network log kept, and every process it started ended by pid.

    with headless_chromium() as browser:   # None-safe: see `missing()` first
        browser.driver.get(url)
        browser.console_errors(), browser.requests()
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL_HINT = "apt-get install -y --no-install-recommends chromium chromium-driver"
# What works as root on a machine without a display or a network beyond loopback.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def missing() -> str | None:
    """Why no browser can be started here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed ({INSTALL_HINT})"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra: ./scripts/setup.sh)"
    return None


@dataclass
class Browser:
    driver: Any  # selenium's WebDriver

    def console_errors(self) -> list[str]:
        """The console's SEVERE entries since the last call (a failed load, an uncaught error...)."""
        return [e["message"] for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]

    def requests(self) -> list[dict]:
        """Every request the page sent since the last call: {"url", "headers"} from the network log."""
        sent = []
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                request = message["params"]["request"]
                sent.append({"url": request["url"], "headers": request.get("headers", {})})
        return sent


def _options(profile: str, width: int, height: int) -> Any:
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return options


@contextmanager
def headless_chromium(width: int = 1400, height: int = 1000) -> Iterator[Browser]:
    """Chromium on a fresh profile (a temp folder, removed after); quit at
    the end, and whatever of its process tree is left is killed by pid."""
    import psutil
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager reach out
    profile = tempfile.mkdtemp(prefix="mlxd-chromium-")
    service = Service(str(CHROMEDRIVER))
    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=_options(profile, width, height))
        yield Browser(driver)
    finally:
        pids = _tree(service.process.pid) if service.process is not None else []  # before quit: all of it
        try:
            driver.quit() if driver is not None else service.stop()
        except Exception:  # noqa: BLE001 - the pids below are killed whatever quit did
            pass
        for pid in reversed(pids):
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        shutil.rmtree(profile, ignore_errors=True)


def _tree(pid: int) -> list[int]:
    """A process and its descendants, parents first."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.Error:
        return []
