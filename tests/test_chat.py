"""`dgemma chat` (issue #16): driven through a pseudo-terminal with pexpect, and through a pipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

from dgemma.api import default_model_dir  # noqa: E402
from dgemma.tokenizer import Tokenizer  # noqa: E402

SYSTEM = "You are a helpful assistant who answers every question briefly, politely and accurately, in plain English."
CHAT = [sys.executable, "-m", "dgemma.cli", "chat", "--steps", "4", "--max-new-tokens", "32", "--seed", "0", "--system", SYSTEM]
FIGURES = re.compile(r"(\d+) tokens, [\d.]+ tokens/forward, [\d.]+ tok/s, first block [\d.]+s, "
                     r"encoded (\d+) new prompt tokens \((\d+) cached\)")  # fmt: skip
PROMPT = ">>> "

pytestmark = pytest.mark.skipif(not (default_model_dir() / "config.json").exists(), reason="no shipped model")


def chat_env(home) -> dict:
    """A fresh HOME (for the history file) that keeps the native kernels torch already built."""
    built = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    return {**os.environ, "HOME": str(home), "TORCH_EXTENSIONS_DIR": built}


def figures(child) -> tuple[int, int, int]:
    child.expect(FIGURES)
    return tuple(int(g) for g in child.match.groups())


def test_chat_in_a_terminal(tmp_path):
    env = {**chat_env(tmp_path), "TERM": "xterm", "COLUMNS": "250"}
    child = pexpect.spawn(CHAT[0], CHAT[1:], env=env, encoding="utf-8", timeout=60, dimensions=(40, 250))
    try:
        child.expect_exact(PROMPT)
        child.sendline("/help")
        child.expect_exact("/set NAME VALUE")
        child.expect_exact(PROMPT)
        child.sendline("/frobnicate")
        child.expect_exact("unknown command /frobnicate")
        child.expect_exact(PROMPT)

        child.sendline("Hello there")
        _, new1, cached1 = figures(child)
        child.expect_exact(PROMPT)
        child.sendline("How are you today?")
        _, new2, cached2 = figures(child)
        child.expect_exact(PROMPT)
        child.sendline(f"/save {tmp_path / 'two.json'}")
        child.expect_exact("saved 5 messages")
        child.expect_exact(PROMPT)

        # turn 2 encoded only what the prefix cache did not hold: its prompt less the cached
        # blocks of turn 1's prompt and answer
        tok = Tokenizer.from_dir(default_model_dir())
        messages = json.loads((tmp_path / "two.json").read_text())
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        prompt1 = tok.apply_chat_template(messages[:2], add_generation_prompt=True)
        prompt2 = tok.apply_chat_template(messages[:4], add_generation_prompt=True)
        assert (new1, cached1) == (len(prompt1), 0)
        assert new2 + cached2 == len(prompt2)
        assert cached2 >= len(prompt1) // 32 * 32 > 0 and new2 < len(prompt2) - len(prompt1) + 32

        # Ctrl-C during a long generation stops it, not the session; the partial answer stays
        child.sendline("/set max-new-tokens 1024")
        child.expect_exact("max-new-tokens = 1024")
        child.sendline("/set steps 48")
        child.expect_exact("steps = 48")
        child.sendline("/set eos off")  # no EOS: the answer cannot end before the Ctrl-C
        child.expect_exact("eos = off")
        child.expect_exact(PROMPT)
        child.sendline("Tell me a very long story about a dragon.")
        child.expect(r"\[block [3-9], step")  # blocks 1 and 2 committed: there is a partial answer
        child.sendintr()
        child.expect_exact("generation stopped")
        n_partial, _, _ = figures(child)
        assert 0 < n_partial < 1024
        child.expect_exact(PROMPT)
        child.sendline("/set max-new-tokens 32")
        child.sendline("/set steps 4")
        child.sendline("And then?")  # the session goes on after the interrupt
        figures(child)
        child.expect_exact(PROMPT)
        child.sendline(f"/save {tmp_path / 'four.json'}")
        child.expect_exact("saved 9 messages")
        child.expect_exact(PROMPT)
        messages = json.loads((tmp_path / "four.json").read_text())
        assert messages[5]["content"] == "Tell me a very long story about a dragon."
        assert messages[6]["role"] == "assistant" and messages[6]["content"]

        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.expect_exact(PROMPT)
        child.sendintr()  # Ctrl-C at the prompt clears the line
        child.expect_exact(PROMPT)
        child.sendeof()  # Ctrl-D leaves
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
    assert (tmp_path / ".cache" / "dgemma" / "chat_history").exists()


def test_chat_through_a_pipe(tmp_path):
    out = subprocess.run(
        CHAT + ["--no-canvas"], input="Hello there\n/set steps 3\nHow are you?\n", capture_output=True, text=True,
        timeout=60, env=chat_env(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2  # one answer a turn, plain text
    assert "\x1b" not in out.stdout and ">>>" not in out.stdout
    assert "steps = 3" in out.stderr and len(FIGURES.findall(out.stderr)) == 2


def test_chat_with_an_image(tmp_path):
    """/image attaches to the next message; the saved conversation holds the part; the next turn
    finds the image's prefix in the cache; bad files and text-only models are named."""
    from PIL import Image
    from vision_checkpoint import write_vision_checkpoint

    write_vision_checkpoint(tmp_path / "vision")
    picture = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (200, 30, 60)).save(picture)
    (tmp_path / "bad.png").write_bytes(b"no pixels here")
    saved = tmp_path / "chat.json"
    lines = [f"/image {tmp_path / 'bad.png'}", f"/image {picture}", "what is this?", "and its colour?", f"/save {saved}"]
    cmd = [sys.executable, "-m", "dgemma.cli", "chat", "--model", str(tmp_path / "vision"), "--steps", "2",
           "--max-new-tokens", "8", "--seed", "0", "--no-canvas"]  # fmt: skip
    out = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120, env=chat_env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "/image: " in out.stderr and "not an image" in out.stderr and "1 image(s) attached" in out.stderr
    turns = [tuple(int(g) for g in m) for m in FIGURES.findall(out.stderr)]
    assert len(turns) == 2 and turns[1][2] >= turns[0][1] - 32  # turn 2: the image turn's whole blocks were cached
    messages = json.loads(saved.read_text())
    assert messages[0]["content"] == [{"type": "image", "image": str(picture)}, {"type": "text", "text": "what is this?"}]
    assert messages[2]["content"] == "and its colour?"
    # the saved conversation loads back and goes on
    out = subprocess.run(cmd, input=f"/load {saved}\nmore?\n", capture_output=True, text=True, timeout=120, env=chat_env(tmp_path))
    assert out.returncode == 0 and "loaded 4 messages" in out.stderr and len(FIGURES.findall(out.stderr)) == 1, out.stderr
    text_only = subprocess.run(CHAT + ["--no-canvas"], input=f"/image {picture}\n", capture_output=True, text=True, timeout=60,
                               env=chat_env(tmp_path))  # fmt: skip
    assert text_only.returncode == 0 and "has no vision tower" in text_only.stderr
