"""`dgemma run --image/--video`: the prompt the processor builds, and bad media as one line and exit code 2."""

import numpy as np
import pytest
from PIL import Image

import dgemma
from dgemma.cli import main

FAST = ["--max-new-tokens", "8", "--steps", "2", "--seed", "3", "--max-soft-tokens", "70"]


@pytest.fixture(scope="module")
def ckpt(vision_checkpoint):
    return vision_checkpoint


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-media") / "cat.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(path)
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["run", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_image_prompts_with_and_without_chat(capsys, ckpt, image):
    """Without --chat the prompt gets the placeholder and a newline; with it, the images lead the
    user turn. Either way the text is what generate makes of the processor's inputs."""
    model = dgemma.load(ckpt)
    processor = model.processor

    def expected(inputs) -> str:
        out = model.generate([inputs], max_new_tokens=8, seed=3, max_denoising_steps=2)
        return model.tokenizer.decode(out.sequences[0]) + "\n"

    code, out, err = run(capsys, "describe it", "--model", ckpt, "--image", image, *FAST)
    assert code == 0, err
    assert out == expected(processor(processor.image_token + "\ndescribe it", images=[image], max_soft_tokens=70))
    code, out, err = run(capsys, "describe it", "--model", ckpt, "--image", image, "--image", image, "--chat", *FAST)
    assert code == 0, err
    content = [{"type": "image", "image": image}] * 2 + [{"type": "text", "text": "describe it"}]
    assert out == expected(processor.apply_chat_template([{"role": "user", "content": content}], max_soft_tokens=70))


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--image", "{tmp}/missing.png"], "not found"),
        (["--image", "{tmp}/not-an-image.png"], "not an image"),
        (["--video", "{tmp}/not-an-image.png"], "video"),
        (["--image", "{image}", "--max-soft-tokens", "100"], "--max-soft-tokens: must be one of 70"),
        (["--image", "{image}", "--mode", "ar"], "diffusion mode only"),
        (["--image", "{image}", "--image", "{image}", "--prompt-has-one"], "placeholder"),
    ],
    ids=["missing file", "not an image", "not a video", "bad budget", "ar mode", "placeholder count"],
)
def test_bad_media_is_one_line_and_exit_2(capsys, tmp_path, ckpt, image, argv, words):
    (tmp_path / "not-an-image.png").write_bytes(b"plain text, no pixels")
    prompt = "describe it"
    if "--prompt-has-one" in argv:
        argv.remove("--prompt-has-one")
        prompt = "<|image|> describe it"
    argv = [a.format(tmp=tmp_path, image=image) for a in argv]
    code, out, err = run(capsys, prompt, "--model", ckpt, *FAST, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("dgemma: error:") and words in err, err


def test_image_on_the_text_only_model(capsys, image):
    code, _, err = run(capsys, "describe it", "--image", image)
    assert code == 2 and "no vision tower" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--allowed-media-dir", "/no/such/dir"], "not a directory"),
        (["--max-images-per-request", "-1"], "--max-images-per-request"),
    ],
)
def test_bad_serve_media_flags(capsys, argv, words):
    code = main(["serve", "--port", "0", *argv])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err
