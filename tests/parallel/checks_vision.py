"""Images on a model cut across the ranks: the vision tower runs on rank 0 and its soft tokens
reach the others (engine/runner.py); `generate` with images gives the whole model's tokens, and
only rank 0's tower runs."""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import dgemma
from dgemma.api import Model
from dgemma.inputs.model_inputs import ImagePatches, ModelInputs
from dgemma.parallel.group import ShardGroup
from dgemma.parallel.shard import shard_model

sys.path.insert(0, str(Path(__file__).parent.parent))  # tests/: the checkpoint writers (imported when run)


def _image(width: int, height: int, seed: int) -> ImagePatches:
    """Random patches of a width x height image (a multiple of 9 patches: one soft token per 3 x 3)."""
    n, budget = width * height, 70 * 9
    pixels = np.zeros((budget, 768), np.float32)
    pixels[:n] = torch.rand(n, 768, generator=torch.Generator().manual_seed(seed)).numpy()
    positions = -np.ones((budget, 2), np.int64)
    positions[:n] = np.stack(np.meshgrid(np.arange(width), np.arange(height), indexing="xy"), -1).reshape(n, 2)
    return ImagePatches(pixels, positions, n // 9)


def _prompt(images: list[ImagePatches], text=(20, 21)) -> ModelInputs:
    from vision_checkpoint import TOKEN_IDS

    boi, eoi, image = TOKEN_IDS["boi_token_id"], TOKEN_IDS["eoi_token_id"], TOKEN_IDS["image_token_id"]
    ids = [2, *text]
    for im in images:
        ids += [boi, *[image] * im.num_soft_tokens, eoi, 30]
    return ModelInputs(ids + [40], list(images), image)


def check_images_generate_like_one_process(group: ShardGroup) -> None:
    from vision_checkpoint import write_vision_checkpoint

    path = Path(tempfile.gettempdir()) / f"dgemma-parallel-vision-{os.environ['MASTER_PORT']}"
    if group.rank == 0:
        write_vision_checkpoint(path, processor=False, generation={"eos_token_id": [1], "pad_token_id": 0})
    group.barrier()
    whole = dgemma.load(path, dtype="float32")
    cut = Model(shard_model(copy.deepcopy(whole.net), group), whole.generation_config, whole.tokenizer, path)
    towers, tower = [], type(cut.net.vision).image_features

    def counted(self, *args):  # the split model's tower runs (the engine's copy of the network's included)
        towers.append(1)
        return tower(self, *args)

    # a random checkpoint: self-conditioning amplifies float rounding (x40 a pass here), so whole runs
    # part after a few passes; the first pass after a prompt with images is compared, value by value
    for inputs, seed in (
        (_prompt([_image(9, 6, 0), _image(6, 12, 1)]), 2),
        (_prompt([_image(3, 3, 2)], text=(22,)), 3),
    ):
        want = next(e for e in whole.stream(inputs, drafts=True, seed=seed, max_new_tokens=8) if hasattr(e, "entropy"))
        type(cut.net.vision).image_features = counted
        try:
            got = next(e for e in cut.stream(inputs, drafts=True, seed=seed, max_new_tokens=8) if hasattr(e, "entropy"))
        finally:
            type(cut.net.vision).image_features = tower
        assert got.canvas == want.canvas and got.accepted == want.accepted, (got, want)
        torch.testing.assert_close(torch.tensor(got.entropy), torch.tensor(want.entropy), rtol=1e-3, atol=1e-3)
    every = group.all_gather(torch.tensor([len(towers)]))  # (a collective: every rank has read the checkpoint)
    if group.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    assert every[0].item() == 3 and every[1:].sum().item() == 0, every  # one tower run per image, on rank 0
