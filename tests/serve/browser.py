"""Debian's chromium, headless, through Selenium and Debian's chromedriver (no downloads: the
apt packages `chromium` and `chromium-driver`, which .ci/run installs), with the network to
anything but 127.0.0.1 blocked. Used by tests/serve/test_playground.py and scripts/playground_screenshot.py."""

from __future__ import annotations

import os

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
MISSING = "Debian's chromium and chromium-driver are not installed (.ci/run installs them with apt-get)"


def available() -> bool:
    return os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)


def launch(profile: str, width: int = 1400, height: int = 900):
    """A headless chromium with a fresh user-data dir `profile`; its console log is kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        # everything but 127.0.0.1 goes to a proxy that does not exist, and no other name resolves
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=127.0.0.1",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    return driver
