"""`dgemma chat` (issue #16): driven through a pseudo-terminal with pexpect, and through a pipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

from dgemma.inputs.tokenizer import Tokenizer  # noqa: E402
from dgemma.loading import default_model_dir  # noqa: E402

SYSTEM = "You are a helpful assistant who answers every question briefly, politely and accurately, in plain English."
CHAT = [
    sys.executable,
    "-m",
    "dgemma.cli",
    "chat",
    "--steps",
    "4",
    "--max-new-tokens",
    "32",
    "--seed",
    "0",
    "--system",
    SYSTEM,
]
FIGURES = re.compile(
    r"(\d+) tokens, [\d.]+ tokens/forward, [\d.]+ tok/s, first block [\d.]+s, "
    r"encoded (\d+) new prompt tokens \((\d+) cached\)"
)
PROMPT = ">>> "

pytestmark = pytest.mark.skipif(not (default_model_dir() / "config.json").exists(), reason="no shipped model")


def chat_env(home) -> dict:
    """A fresh HOME (for the history file) that keeps the native kernels torch already built."""
    built = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    return {**os.environ, "HOME": str(home), "TORCH_EXTENSIONS_DIR": built}


def figures(child) -> tuple[int, int, int]:
    child.expect(FIGURES)
    return tuple(int(g) for g in child.match.groups())


@pytest.mark.slow
@pytest.mark.subprocess
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

        # turn 2 encoded only what the prefix cache did not hold: the full blocks of turn 1's
        # prompt were cached (the one-block answer was never encoded; test_turn_two_keeps_its_prefix
        # checks the prompt itself)
        tok = Tokenizer.from_dir(default_model_dir())
        messages = json.loads((tmp_path / "two.json").read_text())
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        prompt1 = tok.apply_chat_template(messages[:2], add_generation_prompt=True)
        assert (new1, cached1) == (len(prompt1), 0)
        assert cached2 == len(prompt1) // 32 * 32 > 0 and new2 + cached2 > len(prompt1)

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


@pytest.mark.slow
@pytest.mark.subprocess
def test_chat_through_a_pipe(tmp_path):
    out = subprocess.run(
        CHAT + ["--no-canvas"],
        input="Hello there\n/set steps 3\nHow are you?\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=chat_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2  # one answer a turn, plain text
    assert "\x1b" not in out.stdout and ">>>" not in out.stdout
    assert "steps = 3" in out.stderr and len(FIGURES.findall(out.stderr)) == 2


@pytest.mark.slow
@pytest.mark.subprocess
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
    lines = [
        f"/image {tmp_path / 'bad.png'}",
        f"/image {picture}",
        "what is this?",
        "and its colour?",
        f"/save {saved}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "dgemma.cli",
        "chat",
        "--model",
        str(tmp_path / "vision"),
        "--steps",
        "2",
        "--max-new-tokens",
        "8",
        "--seed",
        "0",
        "--no-canvas",
    ]
    out = subprocess.run(
        cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120, env=chat_env(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    assert "/image: " in out.stderr and "not an image" in out.stderr and "1 image(s) attached" in out.stderr
    turns = [tuple(int(g) for g in m) for m in FIGURES.findall(out.stderr)]
    assert len(turns) == 2 and turns[1][2] >= turns[0][1] - 32  # turn 2: the image turn's whole blocks were cached
    messages = json.loads(saved.read_text())
    assert messages[0]["content"] == [
        {"type": "image", "image": str(picture)},
        {"type": "text", "text": "what is this?"},
    ]
    assert messages[2]["content"] == "and its colour?"
    # the saved conversation loads back and goes on
    out = subprocess.run(
        cmd, input=f"/load {saved}\nmore?\n", capture_output=True, text=True, timeout=120, env=chat_env(tmp_path)
    )
    assert out.returncode == 0 and "loaded 4 messages" in out.stderr and len(FIGURES.findall(out.stderr)) == 1, (
        out.stderr
    )
    text_only = subprocess.run(
        CHAT + ["--no-canvas"],
        input=f"/image {picture}\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=chat_env(tmp_path),
    )
    assert text_only.returncode == 0 and "has no vision tower" in text_only.stderr


@pytest.fixture(scope="module")
def tiny():
    import dgemma

    return dgemma.load()


def chat_turns(model, lines: list[str], capsys, system: str | None = None, **knobs):
    """An in-process session (a pipe's): each turn's prompt as passed to the engine, its figures
    (answer tokens, new prompt tokens, cached), and the session. A fresh engine: an empty cache."""
    from dgemma.cli.chat import Session

    model.configure_engine()
    session = Session(model, system, knobs, 0, canvas=False, tty=False)
    prompts, stream = [], model.stream
    model.stream = lambda prompt, **kw: (prompts.append(list(prompt)), stream(prompt, **kw))[1]
    try:
        for line in lines:
            session.command(line) if line.startswith("/") else session.turn(line)
    finally:
        del model.stream
    turns = [tuple(int(g) for g in m) for m in FIGURES.findall(capsys.readouterr().err)]
    return prompts, turns, session


@pytest.mark.slow
def test_turn_two_keeps_its_prefix(tiny, capsys):
    """With a template that trims the answer (Gemma 4's `| trim`), turn 2 still finds turn 1's
    blocks in the prefix cache: its prompt is turn 1's prompt and answer as encoded, then the
    template's end-of-turn, the new user turn and the generation prompt."""
    tok = tiny.tokenizer
    assert "| trim" in tok.chat_template
    # no system prompt: turn 1's prompt (12 tokens) is inside the first block, which the answer's
    # first block (of two, eos off) completes; a re-rendered answer differs there
    lines = ["Hello there", "How are you today?", "And then?"]
    prompts, turns, session = chat_turns(
        tiny, lines, capsys, max_denoising_steps=4, max_new_tokens=64, eos_token_ids=[]
    )
    p1, p2, p3 = prompts
    (_, new1, cached1), (_, new2, cached2), (_, new3, cached3) = turns
    assert (new1, cached1) == (len(p1), 0) and len(p1) < 32
    # everything turn 1 encoded in whole blocks: its prompt and the answer's first block
    assert cached2 == (len(p1) + 32) // 32 * 32 > 0 and new2 + cached2 == len(p2)
    assert cached3 == (len(p2) + 32) // 32 * 32 and new3 + cached3 == len(p3)
    assert p2[: len(p1)] == p1 and p3[: len(p2)] == p2

    # turn 2's prompt holds the whole conversation as the template renders it, but for the
    # whitespace around the answer that the template trims
    messages = session.conversation()
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    answer = messages[1]["content"]
    head = tok.render_chat(messages[:1], add_generation_prompt=True)
    rendered = tok.render_chat(messages[:3], add_generation_prompt=True)
    tail = rendered[len(head) + len(answer) :]
    assert rendered == head + answer + tail and tail.startswith("<turn|>") and tail.endswith("<|turn>model\n")
    text = tok.decode(p2, skip_special_tokens=False)
    assert text.startswith(head) and text.endswith(tail) and text[len(head) : -len(tail)].strip() == answer


def test_set_seed_takes_the_range_of_the_api_and_the_server(tiny, capsys):
    from dgemma.cli.chat import Session

    session = Session(tiny, None, {}, 0, canvas=False, tty=False)
    session.command("/set seed -1")
    assert "/set seed: seed must be an integer in [0, 2**64)" in capsys.readouterr().err and session.seed == 0
    session.command(f"/set seed {2**64 - 1}")
    assert session.seed == 2**64 - 1


def test_set_max_new_tokens_past_the_models_positions_is_refused_with_the_limit(tiny, capsys):
    """Issue 52: `/set max-new-tokens 4000` was accepted and the next message ended the chat."""
    from dgemma.cli.chat import Session

    session = Session(tiny, None, {}, 0, canvas=False, tty=False)
    positions = tiny.config.max_position_embeddings
    session.command(f"/set max-new-tokens {positions * 2}")
    err = capsys.readouterr().err
    limit = re.search(r"past the model's limit: at most (\d+) here \((\d+) positions\)", err)
    assert limit and int(limit.group(2)) == positions and "max_new_tokens" not in session.knobs, err
    most = int(limit.group(1))
    assert 0 < most < positions
    session.command(f"/set max-new-tokens {most + 1}")
    assert "past the model's limit" in capsys.readouterr().err and "max_new_tokens" not in session.knobs
    session.command(f"/set max-new-tokens {most}")
    assert f"max-new-tokens = {most}" in capsys.readouterr().err and session.knobs["max_new_tokens"] == most


def test_a_failed_turn_is_one_line_and_the_conversation_stays(tiny, capsys):
    """A request the engine refuses (here: --max-new-tokens past the positions once the
    conversation has grown) prints one line; the conversation and the session go on."""
    positions = tiny.config.max_position_embeddings
    _, turns, session = chat_turns(tiny, ["Hello there"], capsys, max_denoising_steps=4, max_new_tokens=32)
    assert len(turns) == 1 and len(session.conversation()) == 2
    session.knobs["max_new_tokens"] = positions  # as `--max-new-tokens` gives it: no /set check
    session.turn("How are you today?")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "max_position_embeddings" in lines[0] and "conversation stays" in lines[0], err
    assert len(session.conversation()) == 2  # the refused message is not part of it
    session.knobs["max_new_tokens"] = 32
    session.turn("How are you today?")
    assert FIGURES.search(capsys.readouterr().err) and len(session.conversation()) == 4


def test_a_changed_conversation_is_rendered_afresh(tiny, capsys, tmp_path):
    """/system, /reset: the prompt is the template's rendering of the conversation as it is now."""
    tok = tiny.tokenizer
    saved = tmp_path / "chat.json"
    lines = ["Hello there", "/system Be brief.", "How are you today?", f"/save {saved}", "/reset", "Hello there"]
    prompts, turns, _ = chat_turns(tiny, lines, capsys, max_denoising_steps=4, max_new_tokens=32)
    assert len(turns) == 3
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert prompts[1] == tok.apply_chat_template(messages[:4], add_generation_prompt=True)
    assert prompts[2] == tok.apply_chat_template(messages[:2], add_generation_prompt=True)


@pytest.mark.slow
@pytest.mark.subprocess
def test_chat_template_and_threads_flags(tmp_path):
    """--chat-template FILE renders the prompt; a template Jinja cannot parse, a missing file and
    --threads 0 are one-line errors."""
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{{ bos_token }}A conversation between a person and a model.\n{% for message in messages %}"
        "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}<turn|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
    )
    base = [
        sys.executable,
        "-m",
        "dgemma.cli",
        "chat",
        "--steps",
        "2",
        "--max-new-tokens",
        "32",
        "--seed",
        "0",
        "--no-canvas",
    ]
    out = subprocess.run(
        base + ["--threads", "1", "--chat-template", str(template)],
        input="Hello there\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=chat_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    tok = Tokenizer.from_dir(default_model_dir())
    user = [{"role": "user", "content": "Hello there"}]
    default = tok.apply_chat_template(user, add_generation_prompt=True)
    tok.chat_template = template.read_text()
    ours = tok.apply_chat_template(user, add_generation_prompt=True)
    assert [(int(new), int(cached)) for _, new, cached in FIGURES.findall(out.stderr)] == [(len(ours), 0)]
    assert len(ours) > len(default)

    (tmp_path / "bad.jinja").write_text("{% for message in messages %}{{ message['content'] }}")
    for flags, why in (
        (["--chat-template", str(tmp_path / "bad.jinja")], "is not a valid Jinja template"),
        (["--chat-template", str(tmp_path / "missing.jinja")], "--chat-template: cannot read"),
        (["--threads", "0"], "--threads must be at least 1"),
    ):
        out = subprocess.run(
            base + flags, input="", capture_output=True, text=True, timeout=120, env=chat_env(tmp_path)
        )
        assert out.returncode == 2 and why in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("dgemma: error: "), out.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_ctrl_d_leaves_after_a_stopped_answer(tmp_path):
    """Issue 48's sequence: a message, Ctrl-C within a second, another message and its answer,
    then Ctrl-D at the empty prompt leaves (exit 0). The Ctrl-C stops the answer at its next
    step, never inside the engine's step."""
    env = {**chat_env(tmp_path), "TERM": "xterm", "COLUMNS": "250"}
    child = pexpect.spawn(
        CHAT[0], [*CHAT[1:], "--max-new-tokens", "512"], env=env, encoding="utf-8", timeout=60, dimensions=(40, 250)
    )
    try:
        child.expect_exact(PROMPT)
        child.sendline("/set eos off")  # the answer cannot end before the Ctrl-C
        child.expect_exact(PROMPT)
        child.sendline("Tell me a long story.")
        child.expect(r"\[block 1, step")  # the answer is under way
        child.sendintr()
        child.expect_exact("generation stopped")
        child.expect_exact("encoder tokens in all")  # its figures (no block committed)
        child.expect_exact(PROMPT)
        child.sendline("/set eos default")
        child.expect_exact(PROMPT)
        child.sendline("/set max-new-tokens 32")
        child.expect_exact(PROMPT)
        child.sendline("And then?")
        figures(child)
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF, timeout=20)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


@pytest.mark.slow
@pytest.mark.subprocess
def test_chat_answers_a_file_on_standard_input_on_a_terminal(tmp_path):
    """`dgemma chat < questions.txt` with its output on a terminal: an answer for each line (and
    the commands' lines), exit 0."""
    questions = tmp_path / "questions.txt"
    questions.write_text("Hello there\n/set steps 3\nHow are you?", encoding="utf-8")  # (no final newline)
    command = " ".join(f"'{part}'" for part in [*CHAT, "--no-canvas"]) + f" < '{questions}'; echo exit=$?"
    child = pexpect.spawn(
        "/bin/sh", ["-c", command], env={**chat_env(tmp_path), "TERM": "xterm"}, encoding="utf-8", timeout=120
    )
    try:
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    out = child.before
    assert "exit=0" in out and "steps = 3" in out and len(FIGURES.findall(out)) == 2, out[-2000:]
