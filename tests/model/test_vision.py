"""The vision tower and images in the prompt, against transformers 5.23 (hand-made patches; the
processor has its own tests in test_processor.py)."""

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

import dgemma
from dgemma.inputs.model_inputs import ImagePatches, MediaError, ModelInputs, image_token_runs, splits_image
from vision_checkpoint import TOKEN_IDS, write_vision_checkpoint

BOI, EOI, IMAGE = TOKEN_IDS["boi_token_id"], TOKEN_IDS["eoi_token_id"], TOKEN_IDS["image_token_id"]
MAX_PATCHES = 70 * 9  # the 70-soft-token budget
pytestmark = pytest.mark.parity  # against transformers 5.23


@pytest.fixture(scope="module")
def vision_ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision")
    ref = write_vision_checkpoint(path, processor=False, generation={"eos_token_id": [1], "pad_token_id": 0})
    return path, ref


def patches(width: int, height: int, seed: int, max_patches: int = MAX_PATCHES) -> ImagePatches:
    """A random image of width x height patches, padded as the processor pads it."""
    n = width * height
    g = torch.Generator().manual_seed(seed)
    pixels = np.zeros((max_patches, 768), np.float32)
    pixels[:n] = torch.rand(n, 768, generator=g).numpy()
    positions = -np.ones((max_patches, 2), np.int64)
    gx, gy = np.meshgrid(np.arange(width), np.arange(height), indexing="xy")
    positions[:n] = np.stack([gx, gy], -1).reshape(n, 2)
    return ImagePatches(pixels, positions, n // 9)


def prompt_with(images: list[ImagePatches], text=(20, 21)) -> ModelInputs:
    ids = [2, *text]
    for im in images:
        ids += [BOI] + [IMAGE] * im.num_soft_tokens + [EOI] + [30, 31]
    return ModelInputs(ids + [40], list(images), IMAGE)


def reference_inputs(inputs: ModelInputs) -> dict:
    return {
        "pixel_values": torch.from_numpy(np.stack([im.pixel_values for im in inputs.images])),
        "image_position_ids": torch.from_numpy(np.stack([im.position_ids for im in inputs.images])),
    }


IMAGES = [patches(9, 6, 0), patches(6, 12, 1), patches(3, 3, 2), patches(12, 3, 3)]


def test_image_features_match_reference(vision_ref):
    path, ref = vision_ref
    model = dgemma.load(path)
    batch = ModelInputs([], IMAGES, IMAGE)
    with torch.no_grad():
        want = ref.model.encoder.get_image_features(**reference_inputs(batch)).pooler_output
    padded = model.net.vision.image_features(*reference_inputs(batch).values())
    assert padded.shape == want.shape == (sum(im.num_soft_tokens for im in IMAGES), model.config.hidden_size)
    assert torch.equal(padded, want)  # the reference's padded batch rounds as the reference
    start = 0
    for im in IMAGES:  # the engine's way: one image, real patches only, packed CPU linears
        n = im.num_patches
        one = model.engine_net.vision.image_features(
            torch.from_numpy(im.pixel_values[None, :n]), torch.from_numpy(im.position_ids[None, :n])
        )
        assert (one - want[start : start + im.num_soft_tokens]).abs().max() < 1e-4 * want.abs().max()
        start += im.num_soft_tokens


def _reference_logits(ref, inputs: ModelInputs, canvas: torch.Tensor, bidirectional: bool = True) -> torch.Tensor:
    """The reference's decoder logits after encoding the prompt as `generate` does (its plain
    forward drops the vision masks, see the issue's oracle notes)."""
    x = torch.tensor([inputs.input_ids])
    kwargs = reference_inputs(inputs)
    if bidirectional:
        cache = DynamicCache(config=ref.config.text_config)
        kwargs["past_key_values"] = cache
        kwargs["attention_mask"] = ref.model.encoder.create_masks_for_generate(
            config=ref.config,
            inputs_embeds=torch.empty(1, x.shape[1], 0),
            attention_mask=torch.ones_like(x),
            past_key_values=cache,
            position_ids=torch.arange(x.shape[1])[None],
            mm_token_type_ids=torch.tensor([inputs.mm_token_type_ids]),
        )
    with torch.no_grad():
        return ref(input_ids=x, decoder_input_ids=canvas, **kwargs).logits


@pytest.mark.parametrize("num_images", [1, 2])
def test_canvas_logits_with_images_match_reference(vision_ref, num_images):
    path, ref = vision_ref
    model = dgemma.load(path)
    inputs = prompt_with(IMAGES[:num_images])
    canvas = torch.randint(
        0, model.config.vocab_size, (1, model.config.canvas_length), generator=torch.Generator().manual_seed(num_images)
    )
    want = _reference_logits(ref, inputs, canvas)
    got = model.canvas_logits([inputs], canvas)
    assert (got - want).abs().max().item() < 1e-4
    # the images' bidirectional attention is what makes them match: causal image tokens differ
    assert (got - _reference_logits(ref, inputs, canvas, bidirectional=False)).abs().max().item() > 1e-2
    # and the image content matters
    other = ModelInputs(inputs.input_ids, [patches(9, 6, 9), *IMAGES[1:num_images]], IMAGE)
    assert (model.canvas_logits([other], canvas) - got).abs().max().item() > 1e-2


@pytest.mark.slow
def test_reference_tokens_with_images_equal_generate(vision_ref):
    path, ref = vision_ref
    model = dgemma.load(path)
    for num_images, seed in [(1, 0), (1, 1), (2, 2)]:
        inputs = prompt_with(IMAGES[:num_images])
        x = torch.tensor([inputs.input_ids])
        knobs = {"confidence_threshold": 0.5}
        torch.manual_seed(seed)
        want = ref.generate(
            x,
            **reference_inputs(inputs),
            mm_token_type_ids=torch.tensor([inputs.mm_token_type_ids]),
            max_new_tokens=20,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=1.0),
            **knobs,
        )
        torch.manual_seed(seed)
        got = model.generate([inputs], max_new_tokens=20, sampling="reference", entropy_bound=1.0, **knobs)
        expected = want.sequences[0, x.shape[1] :].tolist()[:20]
        if 1 in expected:
            expected = expected[: expected.index(1) + 1]
        assert got.sequences[0] == expected


@pytest.mark.slow
def test_prefix_cache_keys_hold_image_content(vision_ref):
    """A second request sharing the image prefix encodes only its suffix and equals a cold run; the
    same placeholders with another image share nothing past the text before it."""
    path, _ = vision_ref
    model = dgemma.load(path)
    first = prompt_with(IMAGES[:2], text=tuple(range(20, 30)))
    follow = ModelInputs(first.input_ids + [50, 51, 52, 53, 54, 55, 56, 57, 58], first.images, IMAGE)
    model.generate([first], max_new_tokens=8, seed=3)
    stats = model.engine.stats
    warm = model.generate([follow], max_new_tokens=16, seed=4)
    cached = stats.cached_tokens
    b = model.engine.options.block_size
    full = len(first.input_ids) // b * b
    assert cached == full - (b if splits_image(full, image_token_runs(first.input_ids, IMAGE)) else 0)
    assert cached > IMAGES[0].num_soft_tokens
    assert stats.vision_encodes == 2 and stats.vision_cache_hits == 0  # the cached KV blocks hold both images
    model.configure_engine(prefix_cache=False)
    cold = model.generate([follow], max_new_tokens=16, seed=4)
    assert warm.sequences == cold.sequences and warm.decoder_passes == cold.decoder_passes

    model.configure_engine(prefix_cache=True)
    model.generate([first], max_new_tokens=8, seed=3)
    swapped = ModelInputs(first.input_ids, [patches(9, 6, 7), IMAGES[1]], IMAGE)
    before = model.engine.stats.cached_tokens
    model.generate([swapped], max_new_tokens=8, seed=3)
    first_image = first.input_ids.index(IMAGE)
    assert model.engine.stats.cached_tokens - before == first_image // b * b


@pytest.mark.slow
def test_vision_cache_runs_the_tower_once_per_image(vision_ref):
    path, _ = vision_ref
    model = dgemma.load(path)
    model.configure_engine(prefix_cache=False)
    inputs = prompt_with(IMAGES[:2])
    first = model.generate([inputs], max_new_tokens=8, seed=2)
    again = model.generate([prompt_with(IMAGES[1:2]), inputs], max_new_tokens=8, seed=2)
    stats = model.engine.stats
    assert (stats.vision_encodes, stats.vision_cache_hits) == (2, 3)
    assert again.sequences[1] == first.sequences[0]


@pytest.mark.slow
def test_prefill_chunks_never_split_an_image(vision_ref):
    """A prefill budget smaller than an image still encodes each image in one pass, and the tokens
    equal those of one big chunk (passes fall at block boundaries either way)."""
    path, _ = vision_ref
    model = dgemma.load(path)
    inputs = prompt_with([patches(12, 6, 5), IMAGES[1]])  # 8-token images, blocks of 8
    big = model.generate([inputs], max_new_tokens=16, seed=1)
    model.configure_engine(prefill_chunk=3, prefix_cache=False)
    small = model.generate([inputs], max_new_tokens=16, seed=1)
    assert small.sequences == big.sequences


def test_text_only_checkpoint_refuses_images(vision_ref):
    tiny = dgemma.load()  # the shipped dgemma-tiny: config.json names a vision tower, the weights hold none
    assert tiny.net.vision is None and not tiny.supports_images
    inputs = ModelInputs([2, 5, BOI, IMAGE, EOI], [patches(3, 3, 0)], IMAGE)
    with pytest.raises(MediaError, match="no vision tower"):
        tiny.generate([inputs], max_new_tokens=4)
    assert tiny.generate([[2, 5, 6]], max_new_tokens=4).sequences  # and text still runs


def test_placeholders_must_match_images(vision_ref):
    path, _ = vision_ref
    model = dgemma.load(path)
    inputs = prompt_with(IMAGES[:1])
    short = ModelInputs(inputs.input_ids[:5] + inputs.input_ids[6:], inputs.images, IMAGE)
    with pytest.raises(ValueError, match="soft tokens"):
        model.generate([short], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 images"):
        model.generate([ModelInputs(inputs.input_ids, IMAGES[:2], IMAGE)], max_new_tokens=4)


def test_processor_to_logits_matches_reference(tmp_path):
    """Pixels in: dgemma's processor and model give the reference's logits for a chat with two
    images of different shapes (the processor's own parity is in test_processor.py)."""
    from PIL import Image

    from media_fixtures import save_gemma4_processor

    ref = write_vision_checkpoint(tmp_path, seed=2, generation={"eos_token_id": [1], "pad_token_id": 0})
    model = dgemma.load(tmp_path)
    assert model.supports_images
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(200, 130), (90, 300)]]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "two pictures:"},
                {"type": "image", "image": images[0]},
                {"type": "image", "image": images[1]},
                {"type": "text", "text": "which is wider?"},
            ],
        }
    ]
    inputs = model.processor.apply_chat_template(messages, max_soft_tokens=70)
    proc = save_gemma4_processor(tmp_path / "again")
    want = proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, images_kwargs={"max_soft_tokens": 70}
    )
    assert inputs.input_ids == list(want["input_ids"][0])
    canvas = torch.randint(
        0, model.config.vocab_size, (1, model.config.canvas_length), generator=torch.Generator().manual_seed(0)
    )
    expected = _reference_logits(ref, inputs, canvas)
    assert (model.canvas_logits([inputs], canvas) - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_video_frames_run_as_images(tmp_path):
    """A clip through the processor gives one image per sampled frame behind its timestamp, and the
    engine generates from it; the tower runs once per distinct frame."""
    from media_samples import make_clip

    write_vision_checkpoint(tmp_path, generation={"eos_token_id": [1], "pad_token_id": 0})
    model = dgemma.load(tmp_path)
    inputs = model.processor("<|video|> what happens?", videos=[make_clip()])
    assert len(inputs.images) == 30  # a 30-frame clip: every frame (fewer than the 32 the video config samples)
    text = model.tokenizer.decode(inputs.input_ids, skip_special_tokens=False)
    assert text.count("00:00 <|image>") == 10 and "00:02 <|image>" in text
    out = model.generate([inputs], max_new_tokens=8, seed=0)
    assert len(out.sequences[0]) == 8
    assert model.engine.stats.vision_encodes == 30 and model.engine.stats.image_tokens == inputs.num_image_tokens
