"""A training checkpoint written before layout v3 resumes with today's code (issue 34: "a training
checkpoint written before the move resumes after it"), and no checkpoint pickles a dgemma class,
so moving modules cannot break one.

tests/train/fixtures/train_resume/: a micro run (sizes.json, args.json, data.txt) stopped after step 3
by the code of commit dc95a38, leaving run/checkpoints/step-000002/ (make_fixture.py wrote it)."""

import json
import math
import pickletools
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dgemma.config import load_model_config
from dgemma.model.weights import load_weights
from dgemma.train.resume import STATE_FILE, full_state, latest_checkpoint
from dgemma.train.trainer import TrainArgs, Trainer

FIXTURE = Path(__file__).parent / "fixtures" / "train_resume"
OLD_CHECKPOINT = FIXTURE / "run" / "checkpoints" / "step-000002"


def run_args(root: Path, out: str) -> TrainArgs:
    """The fixture's run, writing to root/out (its data, sizes and tokenizer copied to root)."""
    for name in ("data.txt", "sizes.json"):
        shutil.copy(FIXTURE / name, root / name)
    shutil.copy(OLD_CHECKPOINT / "tokenizer.json", root / "tokenizer.json")
    return TrainArgs(
        out=str(root / out),
        data=[str(root / "data.txt")],
        config=str(root / "sizes.json"),
        tokenizer=str(root / "tokenizer.json"),
        **json.loads((FIXTURE / "args.json").read_text()),
    )


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def pickled_modules(state_file: Path) -> set[str]:
    """The modules whose classes or functions a torch.save file's pickle names."""
    with zipfile.ZipFile(state_file) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    modules, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            modules.add(arg.split(" ")[0])
        elif op.name == "STACK_GLOBAL":
            modules.add(strings[-2])
        if isinstance(arg, str):
            strings.append(arg)
    return modules


def test_a_checkpoint_from_before_layout_v3_resumes(tmp_path):
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step-000002"
    trainer = Trainer(run_args(tmp_path, "run"))
    assert trainer.step == 2

    # the weights and the optimizer state are the old checkpoint's, tensor for tensor
    stored = load_file(str(OLD_CHECKPOINT / "model.safetensors"))
    config = load_model_config(OLD_CHECKPOINT)
    want = load_weights(config, OLD_CHECKPOINT).state_dict()
    got = trainer.net.state_dict()
    assert len(stored) > 0 and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    old_state = torch.load(OLD_CHECKPOINT / STATE_FILE, map_location="cpu", weights_only=True)
    _, optim = full_state(trainer.module, trainer.optimizer, 1)
    assert optim["state"].keys() == old_state["optimizer"]["state"].keys()
    for name, slots in old_state["optimizer"]["state"].items():
        assert slots.keys() == optim["state"][name].keys()
        assert all(same(optim["state"][name][k], v) for k, v in slots.items()), name

    result = trainer.run()
    assert result.step == 4 and not result.interrupted
    assert all(math.isfinite(result.last_losses[k]) for k in ("loss", "diffusion", "ar"))
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert final.keys() == stored.keys() and not torch.equal(
        final["model.decoder.embed_tokens.weight"], stored["model.decoder.embed_tokens.weight"]
    )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000004"]


def test_checkpoints_pickle_no_dgemma_class(tmp_path):
    """Old and new trainer states hold plain containers and tensors only: they load with
    weights_only=True and name no dgemma module, so no module move can break them."""
    Trainer(run_args(tmp_path, "new")).run()
    for state_file in (OLD_CHECKPOINT / STATE_FILE, tmp_path / "new" / "checkpoints" / "step-000004" / STATE_FILE):
        modules = pickled_modules(state_file)
        assert modules and not [m for m in modules if m.split(".")[0] == "dgemma"], modules
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        assert set(state) == {"step", "optimizer", "args"}


def test_the_resumed_run_equals_an_uninterrupted_one_where_the_host_computes_alike(tmp_path):
    """Bit for bit on a host whose float arithmetic gave the old run's step-2 weights exactly."""
    fresh = Trainer(run_args(tmp_path, "fresh"))
    fresh.args.keep = 2
    fresh.run()
    old = load_file(str(OLD_CHECKPOINT / "model.safetensors"))
    ours = load_file(str(tmp_path / "fresh" / "checkpoints" / "step-000002" / "model.safetensors"))
    if not all(torch.equal(old[k], ours[k]) for k in old):
        pytest.skip("this host's first two steps differ in rounding from the host that wrote the fixture")
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    Trainer(run_args(tmp_path, "run")).run()
    want = load_file(str(tmp_path / "fresh" / "model.safetensors"))
    got = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
