"""dgemma's video path against Gemma 4's video rules. transformers' Gemma4VideoProcessor needs
torchvision, which cannot be installed here, so its rules are re-implemented below from
`video_processing_gemma4.py` / `video_utils.py` / `processing_gemma4.py` (5.23): frame sampling
(`default_sample_indices_fn`), timestamps (`VideoMetadata.timestamps`) and the prompt layout
(`replace_video_token`), with every frame's placeholders the image token in dgemma."""

import io
import math

import av
import numpy as np
import pytest

from dgemma.inputs.decode import open_video
from dgemma.inputs.model_inputs import MediaError, image_token_runs
from dgemma.inputs.processor import Processor, VideoProcessorConfig, format_timestamp, sample_frame_indices
from dgemma.inputs.tokenizer import Tokenizer
from media_fixtures import save_gemma4_processor
from media_samples import (  # make_clip: a 3 s clip of FPS x FRAMES, one colour a frame
    FPS,
    FRAMES,
    HEIGHT,
    WIDTH,
    colour,
    make_clip,
)


@pytest.fixture(scope="module")
def clip():
    return make_clip()


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_video")
    save_gemma4_processor(path)
    return Processor.from_dir(path, Tokenizer.from_dir(path))


def gemma4_indices(total, video_fps, num_frames=None, fps=None):
    """transformers' default_sample_indices_fn (which refuses num_frames > total; dgemma takes all frames then)."""
    if num_frames is None and fps is not None:
        num_frames = max(1, int(total / video_fps * fps))
    if num_frames is None:
        return list(range(total))
    num_frames = min(num_frames, total)
    return (np.arange(num_frames, dtype=int) * total // num_frames).tolist()


def gemma4_frame_tokens(height, width, max_soft_tokens, patch=16, pool=3):
    """Soft tokens of one frame: get_aspect_ratio_preserving_size, then patches / pool^2."""
    target = max_soft_tokens * pool**2 * patch**2
    factor = math.sqrt(target / (height * width))
    unit = pool * patch
    h, w = math.floor(factor * height / unit) * unit, math.floor(factor * width / unit) * unit
    return (h // patch) * (w // patch) // pool**2


def gemma4_video_text(indices, video_fps, n):
    """replace_video_token's layout, with the image token: `MM:SS <boi><image>*n<eoi>` joined by spaces."""
    stamps = [f"{int(i / video_fps // 60):02d}:{int(i / video_fps % 60):02d}" for i in indices]
    return " ".join(f"{t} <|image>{'<|image|>' * n}<image|>" for t in stamps)


def with_video_config(proc, **kwargs):
    return Processor(proc.tokenizer, proc.image_config, VideoProcessorConfig(**kwargs))


SETTINGS = [{}, {"num_frames": 8}, {"num_frames": None, "fps": 2.0}, {"do_sample_frames": False}]


@pytest.mark.parametrize("settings", SETTINGS)
def test_sampling_timestamps_and_layout(proc, clip, settings):
    p = with_video_config(proc, **settings)
    inputs = p("Watch <|video|> and tell.", videos=[clip])
    sampling = settings.get("do_sample_frames", True)
    num_frames = settings.get("num_frames", 32) if sampling else None
    indices = gemma4_indices(FRAMES, FPS, num_frames, settings.get("fps") if sampling else None)
    n = gemma4_frame_tokens(HEIGHT, WIDTH, 70)
    expected = "Watch " + gemma4_video_text(indices, FPS, n) + " and tell."
    assert inputs.input_ids == proc.tokenizer.encode(expected)
    assert inputs.input_ids[0] == 2
    assert len(inputs.images) == len(image_token_runs(inputs.input_ids, inputs.image_token_id)) == len(indices)
    assert all(im.num_soft_tokens == n for im in inputs.images)
    assert sum(inputs.mm_token_type_ids) == n * len(indices)  # the image token, not <|video|>
    assert proc.tokenizer.token_to_id("<|video|>") not in inputs.input_ids
    # each frame is the one sampled: solid frames stay their colour after resizing
    for i, im in zip(indices, inputs.images):
        assert np.abs(im.pixel_values[: im.num_patches] * 255 - np.tile(colour(i), 256)).max() < 0.01
        assert (im.position_ids[im.num_patches :] == -1).all()
        assert im.pixel_values.shape == (70 * 9, 768)


def test_sample_rule_and_timestamps():
    assert sample_frame_indices(30, 10.0, 8) == gemma4_indices(30, 10, 8) == [0, 3, 7, 11, 15, 18, 22, 26]
    assert sample_frame_indices(300, 25.0, 32) == gemma4_indices(300, 25, 32)
    assert sample_frame_indices(90, 30.0, None, 1.0) == gemma4_indices(90, 30, None, 1.0) == [0, 30, 60]
    assert sample_frame_indices(5, 30.0, None, 1.0) == [0]  # at least one frame
    assert sample_frame_indices(4, 10.0, 32) == [0, 1, 2, 3]  # shorter than num_frames: every frame
    stamps = [format_timestamp(s) for s in (0.0, 0.9, 59.99, 75.5, 3600.0)]
    assert stamps == ["00:00", "00:00", "00:59", "01:15", "60:00"]


def test_decode_metadata_and_frames(clip):
    """open_video keeps exactly the sampled frames (as decoded by PyAV) with the stream's metadata."""
    wanted = [0, 7, 29]
    video = open_video(clip, lambda m: wanted)
    m = video.metadata
    assert (m.total_num_frames, m.fps, m.width, m.height) == (FRAMES, FPS, WIDTH, HEIGHT)
    assert m.duration == pytest.approx(3.0) and m.frames_indices == wanted
    assert m.timestamps == pytest.approx([0.0, 0.7, 2.9])
    with av.open(io.BytesIO(clip)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    np.testing.assert_array_equal(video.frames, np.stack([decoded[i] for i in wanted]))
    mp4 = open_video(make_clip("mp4", "mpeg4", "yuv420p"))  # a container that stores the frame count
    assert mp4.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and mp4.metadata.total_num_frames == FRAMES


def test_video_with_image_and_chat(proc, clip, tmp_path):
    from PIL import Image

    image = Image.new("RGB", (96, 96), (9, 99, 199))
    (tmp_path / "clip.mkv").write_bytes(clip)
    p = with_video_config(proc, num_frames=4)
    inputs = p("<|video|> vs <|image|>", images=[image], videos=[tmp_path / "clip.mkv"])
    assert len(inputs.images) == 5 and inputs.images[4].num_soft_tokens == 256  # text order: frames, then the image
    parts = [{"type": "video", "video": clip}, {"type": "text", "text": "what happens?"}]
    messages = [{"role": "user", "content": parts}]
    chat = p.apply_chat_template(messages)
    n = gemma4_frame_tokens(HEIGHT, WIDTH, 70)
    text = "<bos><|turn>user\n" + gemma4_video_text([0, 7, 15, 22], FPS, n) + "what happens?<turn|>\n<|turn>model\n"
    assert chat.input_ids == proc.tokenizer.encode(text, add_special_tokens=False) and chat.input_ids.count(2) == 1
    assert len(p("<|video|>", videos=[clip], video_max_soft_tokens=140).images[0].pixel_values) == 140 * 9


def test_video_errors(proc, clip, tmp_path):
    cases = [
        (b"", "empty video data"),
        (b"\x00\x01 definitely not a video " * 10, "cannot decode video"),
        (tmp_path / "missing.mp4", "video file not found"),
        (3.5, "unsupported video source type float"),
    ]
    for source, message in cases:
        with pytest.raises(MediaError, match=message):
            open_video(source)
    with pytest.raises(MediaError, match="over the limit of 0.001 megapixels"):
        open_video(clip, max_pixels=1000)
    with pytest.raises(MediaError, match="30 video frames requested, over the limit of 10"):
        open_video(clip, max_frames=10)
    with pytest.raises(MediaError, match=r"text has no <\|video\|> placeholder"):
        proc("a video", videos=[clip])
