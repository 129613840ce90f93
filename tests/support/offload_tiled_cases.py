"""Cases for the offloaded-checkpoint and tiled-MLP tests: tiny models of the three MLP kinds (gated SiLU Llama,
plain-GeLU GPT-2, Mixtral MoE), all checkpointed, and one CP training step's loss and gradients."""

from __future__ import annotations

import torch

ARCHS = ("llama", "gpt2", "mixtral")  # gated SiLU, plain GeLU (Conv1D fc), routed experts
TILE = 5  # tokens per MLP tile: several tiles on every rank at every world size


def tiny(arch: str):
    """A tiny fp32 model of `arch`, checkpointed, in train mode, identical for identical arguments."""
    from longdoc import models

    if arch == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, vocab_size=256,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0, initializer_range=0.1)
        model = models.from_config(config, seed=1)
    else:
        model = models.tiny_model(arch, seed=1)
    model.config.use_cache = False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch(seq_len: int = 96, seed: int = 3) -> dict:
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def step(model, cp, full: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's loss share and local gradients after one forward/backward under CP."""
    model.zero_grad(set_to_none=True)
    loss = model(**cp.shard_batch(full)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Normwise relative error ||got - want|| / ||want||: the measure of fp32 rounding that does not depend on which
    single element a BLAS's blocking happens to round last (the tiles' matmuls have other row counts than the
    untiled one, so their last bits differ by CPU kernel: the max-element measure read 1.07e-6 on a CPU without
    AVX-512 where it reads below 1e-6 on one with it)."""
    got, want = got.double(), want.double()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-30)).item()
