"""A tiny Gemma 4 processor written by transformers 5.23 (`Gemma4Processor.save_pretrained`): the
tokenizer and processor files of a test vision checkpoint, and the parity oracle for dgemma's
processor. Tests only: runtime code never imports transformers.

Token ids: dgemma's SPECIAL_TOKENS at 0..9 (<pad>, <eos>, <bos>, ...), then Gemma 4's
boi "<|image>" = 10, eoi "<image|>" = 11, image "<|image|>" = 12, video "<|video|>" = 13 and the
audio tokens "<|audio>" = 14, "<audio|>" = 15, "<|audio|>" = 16 (transformers' Gemma4Processor
refuses every call when the tokenizer has no begin/end-of-audio token), then the 256 byte symbols.

torchvision cannot be installed here, and transformers' Gemma4VideoProcessor needs it, so the
processor holds a stand-in video processor that saves Gemma 4's released video settings; it
cannot process videos (tests/inputs/test_video.py re-implements the video rules instead).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dgemma.inputs.tokenizer import GEMMA4_CHAT_TEMPLATE
from dgemma.model.checkpoint import SPECIAL_TOKENS

MEDIA_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}
TOKEN_IDS = {name: len(SPECIAL_TOKENS) + i for i, name in enumerate(MEDIA_TOKENS)}  # boi 10, eoi 11, image 12, video 13

# Gemma 4's released video_processor section of processor_config.json.
GEMMA4_VIDEO_PROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_sample_frames": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "max_soft_tokens": 70,
    "num_frames": 32,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "return_metadata": False,
    "video_processor_type": "Gemma4VideoProcessor",
}


def media_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: the specials and media tokens at fixed small ids, then bytes."""
    specials = SPECIAL_TOKENS + list(MEDIA_TOKENS.values())
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({ch: len(specials) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def _video_processor_stand_in(settings: dict):
    """A VideoProcessorMixin that only saves `settings` (Gemma4VideoProcessor needs torchvision)."""
    from transformers.video_processing_utils import VideoProcessorMixin

    class Gemma4VideoProcessorStandIn(VideoProcessorMixin):
        def to_dict(self):
            return dict(settings)

        def __call__(self, *args, **kwargs):
            raise NotImplementedError("the stand-in video processor cannot process videos (no torchvision)")

    return Gemma4VideoProcessorStandIn()


def build_gemma4_processor(
    chat_template: str = GEMMA4_CHAT_TEMPLATE, max_soft_tokens: int = 280, video: dict | None = None
):
    """transformers' Gemma4Processor over the media tokenizer, Gemma4ImageProcessorPil and the stand-in."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
        PreTrainedTokenizerFast,
    )

    named = {k: v for k, v in MEDIA_TOKENS.items() if k != "video_token"}  # Gemma4Processor adds <|video|> itself
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=media_tokenizer(),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        add_bos_token=True,
        extra_special_tokens=named,
    )
    checks = Gemma4Processor.check_argument_for_proper_class

    def check(self, name, arg):  # transformers cannot find VideoProcessorMixin without torchvision
        return type(arg) if name == "video_processor" else checks(self, name, arg)

    with mock.patch.object(Gemma4Processor, "check_argument_for_proper_class", check):
        return Gemma4Processor(
            feature_extractor=Gemma4AudioFeatureExtractor(),
            image_processor=Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens),
            tokenizer=tokenizer,
            video_processor=_video_processor_stand_in({**GEMMA4_VIDEO_PROCESSOR, **(video or {})}),
            chat_template=chat_template,
        )


def save_gemma4_processor(path: str | Path):
    """Write the processor's files to `path` (tokenizer.json, tokenizer_config.json,
    processor_config.json, chat_template.jinja) and return the transformers Gemma4Processor."""
    processor = build_gemma4_processor()
    processor.save_pretrained(str(path))
    return processor
