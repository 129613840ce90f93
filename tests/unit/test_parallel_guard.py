"""The pieces of the collective guard that run in one process: tags survive the exchange, gradient coverage
names the parameters that got no gradient, the switch, and the chunked loss keeps the head in the graph."""

from __future__ import annotations

import pytest
import torch

from longdoc.parallel.guard import CollectiveMismatchError, GradCoverage, _decode, _encode, debug_collectives_from_env


def test_tag_round_trip_and_cut():
    assert _decode(_encode(7, 909360, "ddp bucket 0 all_reduce")) == (7, 909360, "ddp bucket 0 all_reduce")
    assert _decode(_encode(1, 8, "x" * 500))[2] == "x" * 72


def test_grad_coverage_names_the_parameter_without_gradient():
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 3), "unused": torch.nn.Linear(3, 3)})
    model["unused"].bias.requires_grad_(False)  # frozen parameters never count
    cover = GradCoverage(model.named_parameters())
    model["used"](torch.ones(2, 3)).sum().backward()
    with pytest.raises(CollectiveMismatchError, match=r"1 trainable parameter\(s\) received no gradient \(unused\.w"):
        cover.check("step 1")
    (model["used"](torch.ones(2, 3)).sum() + model["unused"](torch.ones(2, 3)).sum()).backward()
    cover.check("step 2")  # every one got a gradient in THIS backward
    model["used"](torch.ones(2, 3)).sum().backward()  # an earlier gradient does not count for this backward
    with pytest.raises(CollectiveMismatchError, match="unused.weight"):
        cover.check("step 3")
    cover.remove()


def test_switch(monkeypatch):
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("LONGDOC_DEBUG_COLLECTIVES", value)
        assert debug_collectives_from_env() is on


def test_chunked_loss_without_loss_tokens_still_gives_the_head_a_zero_gradient():
    """Issue 22: a CP rank holding no loss token must still fill every DDP bucket, the head's included."""
    from longdoc.models import tiny_model
    from longdoc.train.loss import LossModel

    model = LossModel(tiny_model("llama", vocab_size=300), chunk_tokens=16)
    ids, pos = torch.randint(0, 300, (1, 32)), torch.arange(32)[None]
    share, ce = model(ids, pos, torch.full((1, 32), -100), 10)
    share.backward()
    assert float(share) == float(ce) == 0.0
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())  # exactly zero: nothing changes numerically
