"""Checkpoints: atomic folders, keep-last-K, exact restore, clear errors for damaged files."""

from __future__ import annotations

import random

import pytest
import torch

from longdoc.train import checkpoint


def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt):
    loss = model(torch.ones(3, 4)).square().sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_roundtrip_restores_model_optimizer_and_rng(tmp_path):
    model, opt = _model_and_optim(0)
    _step(model, opt)
    folder = checkpoint.save(tmp_path, 1, model, opt, {"step": 1, "x": [1, 2]}, keep=2, frozen_too=True)
    _step(model, opt)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = _model_and_optim(1)  # other weights, fresh optimizer
    state = checkpoint.load(folder, model2, opt2, frozen_too=True)
    assert state["step"] == 1 and state["x"] == [1, 2]
    _step(model2, opt2)
    for p, w in zip(model2.parameters(), want, strict=True):
        torch.testing.assert_close(p, w, rtol=0, atol=0)


def test_rng_streams_continue(tmp_path):
    model, opt = _model_and_optim(0)
    torch.manual_seed(5)
    random.seed(5)
    folder = checkpoint.save(tmp_path, 3, model, opt, {"step": 3}, keep=1)
    expect = (torch.rand(4), random.random())
    torch.manual_seed(99)
    random.seed(99)
    checkpoint.load(folder, model, opt)
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1]


def test_only_complete_folders_count_and_keep_last_k(tmp_path):
    model, opt = _model_and_optim(0)
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, model, opt, {"step": step}, keep=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [4, 6]
    (tmp_path / ".step-00000008.tmp" / "state").mkdir(parents=True)  # a write cut short
    (tmp_path / "step-00000009").mkdir()  # no trainer.json: never complete
    (tmp_path / "step-00000010.bak").mkdir()
    assert checkpoint.latest(tmp_path).name == "step-00000006"
    checkpoint.sweep(tmp_path)
    assert not (tmp_path / ".step-00000008.tmp").exists()


def test_damaged_checkpoint_errors_name_the_file(tmp_path):
    model, opt = _model_and_optim(0)
    folder = checkpoint.save(tmp_path, 1, model, opt, {"step": 1}, keep=1)
    shard = next((folder / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match=r"step-00000001/state could not be loaded.*delete"):
        checkpoint.load(folder, model, opt)
    (folder / "trainer.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer.json is unreadable"):
        checkpoint.read_state(folder)


def _frozen_first(seed: int):
    model, _ = _model_and_optim(seed)
    model[0].requires_grad_(False)  # like a LoRA base: not trained, not saved
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_frozen_parameters_are_left_out_and_resume_exactly(tmp_path):
    model, opt = _frozen_first(0)
    _step(model, opt)
    folder = checkpoint.save(tmp_path, 1, model, opt, {"step": 1}, keep=2)
    _step(model, opt)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = _frozen_first(0)  # the same base, a fresh trainable part and optimizer
    with torch.no_grad():
        model2[1].weight.add_(1.0)
    checkpoint.load(folder, model2, opt2)
    _step(model2, opt2)
    for p, w in zip(model2.parameters(), want, strict=True):
        torch.testing.assert_close(p, w, rtol=0, atol=0)


def test_frozen_parameters_of_another_base_are_refused(tmp_path):
    model, opt = _frozen_first(0)
    folder = checkpoint.save(tmp_path, 1, model, opt, {"step": 1}, keep=2)
    model2, opt2 = _frozen_first(0)
    with torch.no_grad():
        model2[0].weight.mul_(2.0)  # a different frozen base: the adapter on top of it would be silently wrong
    with pytest.raises(checkpoint.CheckpointError, match="frozen parameters differ.*model.name"):
        checkpoint.load(folder, model2, opt2)


def _fake_checkpoint(root, step: int):
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    (folder / checkpoint.STATE_FILE).write_text("{}")
    return folder


def test_resume_true_without_a_checkpoint_is_refused_and_auto_starts_fresh(tmp_path):
    """resume=true used to train from step 0 and exit 0 when output_dir held no checkpoint (a typo in it silently
    restarted a long run); transformers' Trainer refuses, and so does longdoc now. resume=auto keeps the old way."""
    root = tmp_path / "run" / "checkpoints"
    with pytest.raises(checkpoint.CheckpointError, match=r"resume=true but output_dir .*run holds no complete "
                                                         r"checkpoint.*resume=auto"):
        checkpoint.starting_point(root, True)
    (root / ".step-00000004.tmp").mkdir(parents=True)  # an interrupted write is no checkpoint either
    with pytest.raises(checkpoint.CheckpointError, match="resume=true but"):
        checkpoint.starting_point(root, True)
    assert checkpoint.starting_point(root, "auto") is None
    assert checkpoint.starting_point(root, False) is None
    _fake_checkpoint(root, 2)
    newest = _fake_checkpoint(root, 3)
    assert checkpoint.starting_point(root, True) == newest
    assert checkpoint.starting_point(root, "auto") == newest
    assert checkpoint.starting_point(root, False, overwrite=True) is None
    with pytest.raises(checkpoint.CheckpointError, match="already holds checkpoints.*resume=true.*overwrite=true"):
        checkpoint.starting_point(root, False)
