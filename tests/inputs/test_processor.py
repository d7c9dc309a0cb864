"""dgemma's Gemma 4 image processor against transformers 5.23's Gemma4Processor (the oracle, saved
by tests/media_fixtures.py), the checkpoint config layouts, and image decoding."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from dgemma.config import ConfigError
from dgemma.inputs.decode import open_image
from dgemma.inputs.model_inputs import MediaError
from dgemma.inputs.processor import (
    ImageProcessorConfig,
    Processor,
    VideoProcessorConfig,
    get_aspect_ratio_preserving_size,
    processor_sub_configs,
)
from dgemma.inputs.tokenizer import ChatTemplateError, Tokenizer
from dgemma.model.checkpoint import byte_tokenizer, tokenizer_config_json
from media_fixtures import TOKEN_IDS, save_gemma4_processor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' processor, dgemma's processor read from the files transformers saved)."""
    path = tmp_path_factory.mktemp("gemma4_processor")
    ref = save_gemma4_processor(path)
    return ref, Processor.from_dir(path, Tokenizer.from_dir(path)), path


def noise(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    if mode == "RGBA":
        a = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        a[: height // 2, :, 3] = 0  # half of it fully transparent
        return Image.fromarray(a, "RGBA")
    a = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(a, "RGB")
    if mode == "P":
        image = image.quantize(16)
        image.info["transparency"] = 3
    elif mode != "RGB":
        image = image.convert(mode)
    return image


IMAGES = {
    "tiny": (5, 3, "RGB"),
    "wide": (640, 120, "RGB"),
    "tall": (90, 700, "RGB"),
    "square": (224, 224, "RGB"),
    "exact-768": (768, 768, "RGB"),  # already the 280-token size: not resized
    "thin-wide": (2000, 20, "RGB"),  # a side rounds to 0: the fallback
    "thin-tall": (15, 1800, "RGB"),
    "rgba": (200, 150, "RGBA"),
    "palette": (120, 160, "P"),
    "gray": (130, 97, "L"),
    "gray-alpha": (64, 80, "LA"),
}


def text_part(s):
    return {"type": "text", "text": s}


def reference(ref, text, images, budget):
    kwargs = {} if budget is None else {"max_soft_tokens": budget}
    out = ref(text=text, images=images, return_tensors="np", **kwargs)
    tokens = ref.image_processor(images, **kwargs)["num_soft_tokens_per_image"]
    return out, list(tokens)


def assert_same(out, tokens, mine):
    assert mine.input_ids == out["input_ids"][0].tolist()
    assert mine.mm_token_type_ids == out["mm_token_type_ids"][0].tolist()
    assert [im.num_soft_tokens for im in mine.images] == tokens
    assert len(mine.images) == out["pixel_values"].shape[0]
    for i, im in enumerate(mine.images):
        assert im.pixel_values.dtype == np.float32 and im.position_ids.dtype == np.int64
        assert im.pixel_values.shape == out["pixel_values"][i].shape
        np.testing.assert_allclose(im.pixel_values, out["pixel_values"][i], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(im.position_ids, out["image_position_ids"][i])


@pytest.mark.parity
@pytest.mark.parametrize("budget", [70, 280])
@pytest.mark.parametrize("name", list(IMAGES))
def test_one_image_matches_transformers(pair, name, budget):
    ref, proc, _ = pair
    width, height, mode = IMAGES[name]
    image = noise(width, height, mode)
    text = "Look: <|image|> what is it?"
    out, tokens = reference(ref, text, [image], budget)
    assert_same(out, tokens, proc(text, images=[image], max_soft_tokens=budget))


def test_two_images_and_sources(pair, tmp_path):
    ref, proc, _ = pair
    a, b = noise(320, 200, seed=1), noise(100, 400, "RGBA", seed=2)
    text = "First <|image|> then <|image|>."
    out, tokens = reference(ref, text, [a, b], 140)
    assert_same(out, tokens, proc(text, images=[a, b], max_soft_tokens=140))
    # the default budget is the config's (280); paths and bytes decode to the same pixels
    out, tokens = reference(ref, text, [a, a], None)
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    assert_same(out, tokens, proc(text, images=[buf.getvalue(), tmp_path / "a.png"]))


@pytest.mark.parity
def test_chat_template_matches_transformers(pair):
    ref, proc, _ = pair
    a, b = noise(300, 180, seed=3), noise(50, 90, "P", seed=4)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "image": a}, text_part(" What is this? ")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [text_part("And"), {"type": "image", "image": b}, text_part("?")]},
    ]
    out = ref.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="np",
        processor_kwargs={"max_soft_tokens": 70},
    )
    tokens = list(ref.image_processor([a, b], max_soft_tokens=70)["num_soft_tokens_per_image"])
    mine = proc.apply_chat_template(messages, max_soft_tokens=70)
    assert_same(out, tokens, mine)
    assert mine.input_ids[0] == 2 and mine.input_ids[1] != 2  # one <bos>: the template writes it
    assert ref.apply_chat_template(messages, add_generation_prompt=True) == proc.render_chat(messages)


def test_chat_parts_with_url_and_path_keys(pair, tmp_path):
    _, proc, _ = pair
    image = noise(60, 60)
    image.save(tmp_path / "x.png")
    by_key = [
        proc.apply_chat_template([{"role": "user", "content": [{"type": "image", key: value}]}])
        for key, value in (("image", image), ("url", str(tmp_path / "x.png")), ("path", tmp_path / "x.png"))
    ]
    assert by_key[0].input_ids == by_key[1].input_ids == by_key[2].input_ids
    assert by_key[0].images[0].key == by_key[1].images[0].key == by_key[2].images[0].key
    with pytest.raises(MediaError, match="type 'audio'"):
        proc.apply_chat_template([{"role": "user", "content": [{"type": "audio", "audio": b"x"}]}])
    with pytest.raises(MediaError, match="has no 'image', 'url' or 'path'"):
        proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
    with pytest.raises(ChatTemplateError, match="content part 0"):
        proc.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])


def test_default_template_flattens_parts(tmp_path, pair):
    """A checkpoint without a chat template: parts become text with placeholders, as Gemma 4 writes them."""
    _, proc, path = pair
    tok = Tokenizer.from_dir(path)
    tok.chat_template = None
    plain = Processor(tok, proc.image_config, proc.video_config)
    messages = [{"role": "user", "content": [text_part(" hi "), {"type": "image", "image": noise(48, 48)}]}]
    expected = "<bos><|turn>user\nhi<|image|><turn|>\n<|turn>model\n"
    assert plain.render_chat(messages) == proc.render_chat(messages) == expected
    assert plain.apply_chat_template(messages).input_ids == proc.apply_chat_template(messages).input_ids


def test_placeholder_errors(pair):
    _, proc, _ = pair
    image = noise(40, 40)
    with pytest.raises(MediaError, match=r"text has no <\|image\|> placeholder"):
        proc("no placeholder here", images=[image])
    with pytest.raises(MediaError, match=r"2 <\|image\|> placeholder\(s\) but 1 image"):
        proc("<|image|> and <|image|>", images=[image])
    with pytest.raises(MediaError, match=r"1 <\|image\|> placeholder\(s\) but 0 image"):
        proc("a <|image|>")
    with pytest.raises(MediaError, match="max_soft_tokens must be one of 70, 140, 280, 560, 1120"):
        proc("<|image|>", images=[image], max_soft_tokens=100)
    with pytest.raises(MediaError, match="not found"):
        proc("<|image|>", images=["/nonexistent/cat.png"])
    with pytest.raises(MediaError, match="image file not found: xxx"):
        proc("<|image|>", images="x" * 5000)  # one item, not a list; and no file can have that name
    assert proc("<|image|>", images=image).input_ids == proc("<|image|>", images=[image]).input_ids


def test_configs_from_both_layouts(pair, tmp_path):
    _, proc, path = pair
    saved = json.loads((path / "processor_config.json").read_text())
    assert "image_processor" in saved and "video_processor" in saved  # what save_pretrained 5.23 writes
    assert not (path / "preprocessor_config.json").exists()
    assert proc.image_config == ImageProcessorConfig() and proc.video_config == VideoProcessorConfig()
    assert (proc.image_token_id, proc.boi_token_id, proc.eoi_token_id) == (
        TOKEN_IDS["image_token"],
        TOKEN_IDS["boi_token"],
        TOKEN_IDS["eoi_token"],
    )
    # transformers 4's layout: flat preprocessor_config.json and video_preprocessor_config.json
    old = tmp_path / "old"
    old.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (old / f).write_bytes((path / f).read_bytes())
    image = dict(saved["image_processor"], max_soft_tokens=560, processor_class="Gemma4Processor")
    (old / "preprocessor_config.json").write_text(json.dumps(image))
    (old / "video_preprocessor_config.json").write_text(json.dumps(dict(saved["video_processor"], num_frames=8)))
    image_cfg, video_cfg = processor_sub_configs(old)
    assert image_cfg["max_soft_tokens"] == 560 and video_cfg["num_frames"] == 8
    loaded = Processor.from_dir(old, Tokenizer.from_dir(old))
    assert loaded.image_config.max_soft_tokens == 560 and loaded.video_config.num_frames == 8
    (old / "preprocessor_config.json").write_text(json.dumps(dict(image, max_soft_tokens=300)))
    with pytest.raises(ConfigError, match="must be one of 70, 140, 280, 560, 1120"):
        Processor.from_dir(old, Tokenizer.from_dir(old))


def test_from_dir_without_processor_or_image_token(pair, tmp_path):
    _, _, path = pair
    assert Processor.from_dir(tmp_path, Tokenizer.from_dir(path)) is None  # no processor config
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config_json()))
    (tmp_path / "processor_config.json").write_bytes((path / "processor_config.json").read_bytes())
    assert Processor.from_dir(tmp_path, Tokenizer.from_dir(tmp_path)) is None  # no <|image|> token


def test_aspect_ratio_rule():
    # 280 tokens: 2520 patches of 16 px in multiples of 48 px
    assert get_aspect_ratio_preserving_size(512, 512, 16, 2520, 3) == (768, 768)
    assert get_aspect_ratio_preserving_size(1080, 1920, 16, 2520, 3) == (576, 1056)
    assert get_aspect_ratio_preserving_size(20, 2000, 16, 630, 3) == (48, 3360)  # zero-side fallback, capped
    assert get_aspect_ratio_preserving_size(1800, 15, 16, 630, 3) == (3360, 48)


# ------------------------------------------------------------------------------------ decoding
def encoded(image, fmt, **kwargs):
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_formats(fmt, tmp_path):
    image = Image.new("RGB", (40, 30), (200, 40, 90))
    data = encoded(image, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    (tmp_path / f"x.{fmt.lower()}").write_bytes(data)
    for source in (data, tmp_path / f"x.{fmt.lower()}", str(tmp_path / f"x.{fmt.lower()}")):
        out = open_image(source)
        assert out.mode == "RGB" and out.size == (40, 30)
        assert np.abs(np.asarray(out, dtype=int) - (200, 40, 90)).max() <= (8 if fmt in ("JPEG", "GIF") else 0)


def test_decode_gif_first_frame_and_alpha_on_white():
    frames = [Image.new("RGB", (20, 20), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    out = np.asarray(open_image(buf.getvalue()))
    assert out[0, 0, 0] > 200 and out[0, 0, 2] < 50  # red, the first frame
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))  # fully transparent black
    assert (np.asarray(open_image(encoded(rgba, "PNG"))) == 255).all()  # composited onto white


def test_decode_exif_orientation():
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 10, 20))  # white on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turned 90 degrees clockwise
    out = open_image(encoded(image, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (20, 40)
    top = np.asarray(out)[:10].mean()
    assert top > 200  # the left strip is now on top


def test_decode_errors(monkeypatch, tmp_path):
    png = encoded(Image.new("RGB", (64, 64), (1, 2, 3)), "PNG")
    cases = [
        (b"", "empty image data"),
        (b"this is not an image", "not an image"),
        (png[: len(png) // 2], "truncated or corrupt PNG"),
        (encoded(Image.new("RGB", (8, 8)), "BMP"), "unsupported image format BMP"),
        (encoded(Image.new("RGB", (8, 8)), "TIFF"), "unsupported image format TIFF"),
        (12345, "unsupported image source type int"),
        (tmp_path / "missing.png", "image file not found"),
    ]
    for source, message in cases:
        with pytest.raises(MediaError, match=message):
            open_image(source)
    with pytest.raises(MediaError, match=r"64x64 \(0.0 megapixels\), over the limit of 0.001 megapixels"):
        open_image(png, max_pixels=1000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's own bomb guard trips first
    with pytest.raises(MediaError, match="too large to decode safely"):
        open_image(png)
