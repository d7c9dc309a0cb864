"""The README's screenshot of the playground page: dgemma serve's page in headless chromium,
caught while a block denoises (a frame with under half of the canvas accepted). The first turn
runs at full speed (its figures are real); during the second, each decoder pass sleeps 0.4 s, so
that the capture (slower than a pass of dgemma-tiny) lands on one frame as the server sent it.

    python scripts/playground_screenshot.py [--out docs/images/playground.png] [--seed N]

Needs Debian's chromium and chromium-driver (apt) and selenium (the test extra).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import browser  # noqa: E402  (tests/serve/browser.py: chromium without network)

import dgemma  # noqa: E402
from dgemma.engine.runner import Runner  # noqa: E402
from dgemma.serve.app import create_app  # noqa: E402
from dgemma.serve.http.listener import ServerThread  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime.", "Now make it faster."]


def slow_passes(seconds: float = 0.4) -> None:
    step = Runner.decoder_step

    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        return step(self, *args, **kwargs)

    Runner.decoder_step = slowed


def main() -> None:
    from selenium.webdriver.common.by import By

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "playground.png")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not browser.available():
        sys.exit(browser.MISSING)
    model = dgemma.load()
    with ServerThread(create_app(model, "dgemma-tiny")) as server, tempfile.TemporaryDirectory() as profile:
        driver = browser.launch(profile, 1400, 860)
        try:
            driver.get(server.url + "/")
            time.sleep(1)
            driver.find_element(By.ID, "seed").send_keys(str(args.seed))
            for k, prompt in enumerate(PROMPTS):
                if k == len(PROMPTS) - 1:
                    slow_passes()
                driver.find_element(By.ID, "input").send_keys(prompt)
                driver.find_element(By.ID, "send").click()
                if k < len(PROMPTS) - 1:
                    while (
                        len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")) <= k
                        or not driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .figures")[k].text
                    ):
                        time.sleep(0.1)
            half = model.config.canvas_length // 2
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # a frame mid-block, still on screen after the capture
                frames = driver.execute_script("return window.dgemma.frames.length")
                last = driver.execute_script("return window.dgemma.frames.at(-1)")
                if last and last["block"] >= 1 and last["step"] >= 3 and 0 < last["accepted"] < half:
                    png = driver.get_screenshot_as_png()
                    if driver.execute_script("return window.dgemma.frames.length") == frames:
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_bytes(png)
                        print(
                            f"wrote {args.out} (block {last['block'] + 1}, step {last['step']}, {last['accepted']} accepted)"
                        )
                        return
                time.sleep(0.005)
            sys.exit("no mid-block frame was caught")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
