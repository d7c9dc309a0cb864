"""The playground page of `dgemma serve`: served offline-only (its files and their policy), and
driven end to end in Debian's chromium, headless, with the network to anything but 127.0.0.1
blocked: a message streams draft frames that change and ends in the text the API gives for the
same request; a refused request puts the message back; an image goes up to a vision model.

The browser run saves screenshots under $DGEMMA_TEST_ARTIFACTS (default: test-artifacts/).
"""

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import browser as browser_tools
import httpx
import pytest

import dgemma
from dgemma.serve.app import create_app
from dgemma.serve.http.access import Access
from dgemma.serve.http.listener import ServerThread
from dgemma.serve.playground import STATIC

ARTIFACTS = Path(os.environ.get("DGEMMA_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
PROMPT = "Write a function that adds two numbers."
KNOBS = {"seed": 3, "max_tokens": 64, "max_denoising_steps": 12}


@pytest.fixture(scope="module")
def tiny():
    return dgemma.load()


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(create_app(tiny, "dgemma-tiny", max_active=2, max_queue=4)) as s:
        yield s


# ------------------------------------------------------------------------------------ the files
def test_page_and_assets_are_served_with_an_offline_policy(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    for asset, kind in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
        response = httpx.get(server.url + asset)
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert response.text == (STATIC / asset.removeprefix("/ui/")).read_text()
    assert httpx.get(server.url + "/ui/nothing.js").status_code == 404
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert (
        card["canvas_length"] == 32
        and card["vision"] is False
        and card["sampler_defaults"]["max_denoising_steps"] == 48
    )


def test_the_files_name_no_other_host():
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name  # no CDN, no fonts, no links out
        assert "@import" not in text and "url(" not in text, name


def test_no_ui_turns_the_page_off(tiny):
    with ServerThread(create_app(tiny, "dgemma-tiny", ui=False)) as s:
        response = httpx.get(s.url + "/")
        assert response.status_code == 404 and response.json()["error"]["message"] == "no route /"
        assert httpx.get(s.url + "/ui/app.js").status_code == 404
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------------------ in a browser
@pytest.fixture(scope="module")
def browser():
    if not browser_tools.available():
        pytest.skip(browser_tools.MISSING)
    profile = tempfile.mkdtemp(prefix="dgemma-chromium-")
    driver = browser_tools.launch(profile)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    driver.save_screenshot(str(ARTIFACTS / "playground-timeout.png"))
    raise AssertionError(f"timed out waiting for {what}")


def fill(driver, values: dict) -> None:
    from selenium.webdriver.common.by import By

    for name, value in values.items():
        field = driver.find_element(By.ID, name)
        field.clear()
        field.send_keys(str(value))


def send(driver, text: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answers(driver) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def finished(driver, count: int):
    """The `count`-th answer once its figures are written (the stream has ended)."""
    from selenium.webdriver.common.by import By

    boxes = answers(driver)
    if len(boxes) >= count and boxes[count - 1].find_element(By.CLASS_NAME, "figures").text:
        return boxes[count - 1]
    return None


@pytest.mark.slow
def test_chat_draws_changing_draft_frames_and_ends_in_the_api_text(browser, server):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    wait_for(browser, lambda: "dgemma-tiny" in browser.find_element(By.ID, "model").text, "the model name")
    fill(browser, KNOBS)
    send(browser, PROMPT)
    wait_for(
        browser, lambda: int(browser.find_element(By.ID, "canvas").get_attribute("data-frames")) >= 2, "two frames"
    )
    answer = wait_for(browser, lambda: finished(browser, 1), "the answer")
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))

    frames = browser.execute_script("return window.dgemma.frames")
    assert len(frames) >= 4 and {f["block"] for f in frames} == {0, 1}  # 64 tokens: two canvases of 32
    assert len({f["tokens"] for f in frames}) > 2  # the canvas changed from frame to frame
    assert all(1 <= f["accepted"] <= 32 for f in frames)
    cells = browser.find_elements(By.CSS_SELECTOR, "#canvas .tok")
    assert len(cells) == 32 and {c.get_attribute("class") for c in cells} <= {"tok accepted", "tok noised"}

    expected = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={"model": "dgemma-tiny", "messages": [{"role": "user", "content": PROMPT}], **KNOBS},
    ).json()
    text = expected["choices"][0]["message"]["content"]
    shown = browser.execute_script("return arguments[0].querySelector('.content').textContent", answer)
    assert shown == text and text
    figures = answer.find_element(By.CLASS_NAME, "figures").text
    assert f"{expected['usage']['completion_tokens']} tokens" in figures and "tokens/forward" in figures
    assert "first block" in figures and "tok/s" in figures

    # everything the page loaded came from the server; nothing was logged as an error
    origins = browser.execute_script("return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
    assert set(origins) == {server.url}
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # and the page cannot reach out even if it tried: its policy and the blocked network stop it
    reached = browser.execute_async_script(
        "const done = arguments[0]; fetch('http://example.com/').then(() => done(true), () => done(false));"
    )
    assert reached is False

    # a second turn reuses the first one's prompt from the prefix cache
    send(browser, "Now multiply them.")
    second = wait_for(browser, lambda: finished(browser, 2), "the second answer")
    assert re.search(r"prompt \d+ \([1-9]\d* cached\)", second.find_element(By.CLASS_NAME, "figures").text)


@pytest.mark.slow
def test_a_refused_request_puts_the_message_back(browser, server):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    wait_for(browser, lambda: "dgemma-tiny" in browser.find_element(By.ID, "model").text, "the model name")
    fill(browser, {"max_tokens": 0})
    send(browser, "keep this text")
    wait_for(browser, lambda: "error" in browser.find_element(By.ID, "status").get_attribute("class"), "the error")
    assert "max_tokens" in browser.find_element(By.ID, "status").text
    assert browser.find_element(By.ID, "input").get_attribute("value") == "keep this text"
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    assert browser.execute_script("return window.dgemma.messages.length") == 0


@pytest.mark.slow
def test_an_image_goes_up_to_a_vision_model(browser, tmp_path):
    from PIL import Image
    from selenium.webdriver.common.by import By

    from vision_checkpoint import write_vision_checkpoint

    write_vision_checkpoint(tmp_path / "vision")
    model = dgemma.load(tmp_path / "vision")
    image = tmp_path / "square.png"
    Image.new("RGB", (48, 40), (200, 30, 60)).save(image)
    with ServerThread(create_app(model, "vision", max_active=2)) as s:
        browser.get(s.url + "/")
        wait_for(browser, lambda: "vision" in browser.find_element(By.ID, "model").text, "the model name")
        assert browser.find_element(By.ID, "image-label").is_displayed()
        browser.find_element(By.ID, "image").send_keys(str(image))
        wait_for(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#attachments img"), "the thumbnail")
        fill(browser, {"max_tokens": 8, "max_denoising_steps": 2})
        send(browser, "what is this?")
        answer = wait_for(browser, lambda: finished(browser, 1), "the answer")
        assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img")
        assert not answer.find_element(By.CLASS_NAME, "error").text
        assert re.search(r"\b\d+ image tokens", answer.find_element(By.CLASS_NAME, "figures").text)
        assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")  # sent, not pending


@pytest.mark.slow
def test_the_page_asks_for_the_api_key_and_keeps_it_in_memory(browser, tiny):
    from selenium.webdriver.common.by import By

    with ServerThread(create_app(tiny, "dgemma-tiny", max_active=2, access=Access(api_key="s3cret"))) as s:
        browser.get(s.url + "/")
        wait_for(browser, lambda: browser.find_element(By.ID, "key-form").is_displayed(), "the key form")
        assert "needs an API key" in browser.find_element(By.ID, "status").text
        browser.find_element(By.ID, "api-key").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, lambda: "wrong API key" in browser.find_element(By.ID, "status").text, "the refusal")
        browser.find_element(By.ID, "api-key").send_keys("s3cret")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, lambda: "dgemma-tiny" in browser.find_element(By.ID, "model").text, "the model name")
        fill(browser, {"max_tokens": 8, "max_denoising_steps": 2, "seed": 1})
        send(browser, "hi")
        answer = wait_for(browser, lambda: finished(browser, 1), "the answer")
        assert not answer.find_element(By.CLASS_NAME, "error").text
        # the key lives in the page's memory only: no storage, no cookie, not in the URL
        stored = browser.execute_script(
            "return [localStorage.length, sessionStorage.length, document.cookie, location.href]"
        )
        assert stored[:3] == [0, 0, ""] and "s3cret" not in stored[3]
