"""The newcomer's path through the command line: no silent no-ops (an empty prompt, `-`,
--temperature in diffusion mode, a file as --model), errors that name the flags as typed, the
knobs users reach for (--prompt-file, --threads, --chat-template, a timing line, --quiet), help
for every argument, and weights written with the mode of any new file."""

import argparse
import io
import os
import stat
import sys

import httpx
import pytest

import dgemma
from dgemma.cli import build_parser, main
from dgemma.cli.run import DEMO_MODEL_NOTE

FAST = ["--max-new-tokens", "8", "--seed", "3", "--steps", "4"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("dgemma: error:") and err.count("\n") == 1 and not out, (code, out, err)
    return err


# ------------------------------------------------------------------------------------ the prompt
@pytest.mark.parametrize("prompt", ["", "   ", "\n"])
def test_an_empty_prompt_is_an_error(capsys, prompt):
    assert "the prompt is empty" in one_line_error(capsys, prompt)


def test_no_prompt_says_how_to_give_one(capsys):
    err = one_line_error(capsys)
    assert "'-'" in err and "--prompt-file" in err


@pytest.mark.slow
def test_dash_reads_standard_input_and_prompt_file_reads_a_file(capsys, monkeypatch, tmp_path):
    code, direct, _ = run(capsys, "def add(a, b):", *FAST, "-q")
    assert code == 0 and direct.strip()
    monkeypatch.setattr(sys, "stdin", io.StringIO("def add(a, b):"))
    code, piped, _ = run(capsys, "-", *FAST, "-q")
    assert code == 0 and piped == direct
    (tmp_path / "p.txt").write_text("def add(a, b):", encoding="utf-8")
    code, filed, _ = run(capsys, "--prompt-file", str(tmp_path / "p.txt"), *FAST, "-q")
    assert code == 0 and filed == direct
    assert "not both" in one_line_error(capsys, "x", "--prompt-file", str(tmp_path / "p.txt"))
    assert "cannot read" in one_line_error(capsys, "--prompt-file", str(tmp_path / "nope.txt"))


# ------------------------------------------------------------------------------------ flags
def test_temperature_belongs_to_ar_mode(capsys):
    err = one_line_error(capsys, "x", "--temperature", "0.7")
    assert "--mode ar" in err and "--t-max" in err and "--t-min" in err
    assert ">= 0" in one_line_error(capsys, "x", "--mode", "ar", "--temperature", "-1")
    code, out, _ = run(capsys, "def f", "--mode", "ar", "--temperature", "0.7", "--max-new-tokens", "4", "--seed", "1")
    assert code == 0 and out.strip()


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--steps", "0"], "--steps must be"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be"),
        (["--t-min", "0.9", "--t-max", "0.5"], "--t-max must be greater than --t-min"),
        (["--entropy-bound", "-1"], "--entropy-bound must be"),
    ],
)
def test_sampler_errors_name_the_flags_as_typed(capsys, flags, words):
    err = one_line_error(capsys, "x", *flags)
    assert words in err and "max_denoising_steps" not in err and "t_min" not in err


def test_seed_takes_the_range_of_the_api_and_the_server(capsys):
    for seed in ("-1", str(2**64)):  # dgemma.engine.request.check_seed, before the model loads
        assert "--seed must be an integer in [0, 2**64)" in one_line_error(capsys, "x", "--seed", seed)


def test_a_file_as_model_is_called_a_file(capsys, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file" in one_line_error(capsys, "x", "--model", str(tmp_path / "weights.bin"))
    assert "does not exist" in one_line_error(capsys, "x", "--model", str(tmp_path / "missing"))


def test_threads(capsys):
    assert "--threads must be at least 1" in one_line_error(capsys, "x", "--threads", "0")
    import torch

    before = torch.get_num_threads()
    try:
        code, out, _ = run(capsys, "def f", *FAST, "--threads", "1", "-q")
        assert code == 0 and out.strip() and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_the_timing_line_and_the_demo_note_go_to_stderr(capsys):
    code, out, err = run(capsys, "def add(a, b):", *FAST)
    assert code == 0 and "tokens in" not in out and DEMO_MODEL_NOTE not in out
    lines = err.strip().splitlines()
    assert lines[0] == DEMO_MODEL_NOTE
    assert lines[-1].startswith("dgemma: ") and "tok/s" in lines[-1] and "decoder passes" in lines[-1]
    code, quiet_out, quiet_err = run(capsys, "def add(a, b):", *FAST, "--quiet")
    assert code == 0 and quiet_out == out and quiet_err == ""
    code, _, err = run(capsys, "def add(a, b):", "--model", str(dgemma.default_model_dir()), *FAST)
    assert code == 0 and DEMO_MODEL_NOTE not in err and "tok/s" in err


def test_every_argument_has_help():
    missing = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    walk(subparser, f"{name} {sub}")
            elif action.help is None and not isinstance(action, argparse._HelpAction):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "dgemma")
    assert not missing


# ------------------------------------------------------------------------------------ serve --chat-template
@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_takes_a_chat_template(tmp_path):
    from serve_process import ServeProcess

    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}model:", encoding="utf-8"
    )
    body = {"model": "dgemma-tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    tok = dgemma.load().tokenizer
    with ServeProcess(["--served-model-name", "dgemma-tiny", "--chat-template", str(template), "--threads", "1"]) as s:
        usage = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode("user: hello there\nmodel:", add_special_tokens=False))


# ------------------------------------------------------------------------------------ file modes
def _modes(directory) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir() if p.is_file()}


def test_written_weights_get_the_mode_of_new_files(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["make-tiny", str(tmp_path / "tiny")]) == 0
        assert (
            main(["quantize", "--model", str(tmp_path / "tiny"), "--scheme", "int8", "--out", str(tmp_path / "q")]) == 0
        )
    finally:
        os.umask(old)
    for directory in (tmp_path / "tiny", tmp_path / "q"):
        modes = _modes(directory)
        assert any(name.endswith(".safetensors") for name in modes)
        assert set(modes.values()) == {0o644}, modes


# ------------------------------------------------------------------------------------ bad arguments in one line
@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--size", "nosuch"], "dgemma bench: error: argument --size: invalid choice: 'nosuch'"),
        (["memory", "--card", "24XB"], "dgemma memory: error: argument --card: '24XB' is not a size"),
        (["run", "--steps", "x", "y"], "dgemma run: error: argument --steps: invalid int value: 'x'"),
        (["nosuch"], "dgemma: error: argument command: invalid choice: 'nosuch'"),
    ],
)
def test_bad_arguments_are_one_line_without_the_usage_block(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out = capsys.readouterr()
    assert exit_.value.code == 2 and not out.out and out.err.count("\n") == 1, out.err
    assert out.err.startswith(words) and "usage:" not in out.err
    assert out.err.rstrip().endswith(f"(see `{words.split(':')[0]} --help`)")


def test_grammar_errors_say_what_is_wrong_and_name_the_file(capsys, tmp_path):
    err = one_line_error(capsys, "x", "--regex", "(")
    assert 'regex parse error: unclosed group at character 1 of "("' in err and "at 1(8)" not in err and "^" not in err
    assert "the start must be <= the end at character 2" in one_line_error(capsys, "x", "--regex", "a{2,1}")
    schema = tmp_path / "schema.json"
    for text, words in (('{"type": "objec', "is not valid JSON"), ('{"type": "nosuch"}', "Invalid type")):
        schema.write_text(text)
        err = one_line_error(capsys, "x", "--json-schema", str(schema))
        assert err.startswith(f"dgemma: error: --json-schema {schema}: ") and words in err
    schema.write_bytes(b"\xff\xfe{")
    assert f"--json-schema: cannot read {schema}: " in one_line_error(capsys, "x", "--json-schema", str(schema))
    grammar = tmp_path / "g.lark"
    grammar.write_text("start: nowhere")
    assert f"--grammar {grammar}: " in one_line_error(capsys, "x", "--grammar", str(grammar))


# ------------------------------------------------------------------------------------ issue 52: a new user's frictions
def test_standard_input_that_is_not_utf8_gets_the_prompt_files_message(capsys, monkeypatch, tmp_path):
    data = b"\x89PNG\r\n\x1a\n\x00\xff"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    piped = one_line_error(capsys, "-")
    (tmp_path / "p.bin").write_bytes(data)
    filed = one_line_error(capsys, "--prompt-file", str(tmp_path / "p.bin"))
    assert "standard input ('-'): not UTF-8 text (byte 0x89 at offset 0)" in piped
    assert f"--prompt-file {tmp_path / 'p.bin'}: not UTF-8 text (byte 0x89 at offset 0)" in filed
    assert "TextEncodeInput" not in piped


def test_a_directory_without_config_json_is_not_a_checkpoint_directory(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = one_line_error(capsys, "x", "--model", str(tmp_path / "empty"))
    assert f"{tmp_path / 'empty'} is not a checkpoint directory: it has no config.json" in err


@pytest.mark.parametrize("command", [["run", "x"], ["serve"], ["quantize", "--quantization", "int8", "--out", "o"]])
def test_an_unknown_flag_points_to_its_subcommands_help(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--nosuch-flag"])
    err = capsys.readouterr().err
    name = f"dgemma {command[0]}"
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{name}: error: unrecognized arguments: --nosuch-flag") and f"(see `{name} --help`)" in err


def test_show_canvas_on_a_pipe_says_it_draws_only_on_a_terminal(capsys):
    code, out, err = run(capsys, "def add(a, b):", *FAST, "--show-canvas")  # capsys: not a terminal
    assert code == 0 and out.strip() and "\x1b[" not in out
    assert "--show-canvas draws only on a terminal" in err and err.count("--show-canvas") == 1
    code, quiet_out, quiet_err = run(capsys, "def add(a, b):", *FAST, "--show-canvas", "-q")
    assert code == 0 and quiet_out == out and quiet_err == ""


@pytest.mark.subprocess
def test_output_into_a_reader_that_closes_early_ends_quietly_with_status_0():
    """`dgemma run ... | head -1`: the reader goes early; the writer ends with status 0
    and no BrokenPipeError traceback (as other command-line tools do)."""
    import subprocess

    from serve_process import cli_command

    shell = subprocess.run(  # `true` reads nothing and is gone long before the first block commits
        ["bash", "-c", 'set -o pipefail; "$@" | true', "bash", *cli_command(), "run", "def f(x):", *FAST],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shell.returncode == 0 and "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr, shell.stderr


def test_quantize_speaks_runs_vocabulary(capsys, tmp_path):
    """--quantization (--scheme kept), the shipped model without --model, a progress line, the
    right message for --model with --size, an article-free last line."""
    assert main(["quantize", "--quantization", "int8", "--out", str(tmp_path / "q8")]) == 0
    out = capsys.readouterr()
    assert out.err.startswith(f"dgemma: quantising {dgemma.default_model_dir()} to int8 into {tmp_path / 'q8'}")
    assert out.out.strip() == f"wrote a checkpoint quantised to int8 (compressed-tensors) to {tmp_path / 'q8'}"
    assert (tmp_path / "q8" / "config.json").exists()
    assert main(["quantize", "--scheme", "int8", "--out", str(tmp_path / "alias")]) == 0
    assert "quantised to int8" in capsys.readouterr().out
    code = main(["quantize", "--quantization", "int8", "--model", "x", "--size", "tiny", "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert code == 2 and "give --model (a checkpoint) or --size NAME (random weights of a named size), not both" in err
    assert not (tmp_path / "b").exists()


def test_finetune_and_merge_lora_default_to_the_shipped_model_as_run_does():
    parser = build_parser()
    assert parser.parse_args(["finetune", "--data", "stdlib", "--out", "o"]).model is None
    assert parser.parse_args(["merge-lora", "--adapter", "a", "--out", "o"]).model is None
    assert parser.parse_args(["run", "x"]).model is None  # (resolve_model: None is dgemma-tiny, for all three)
