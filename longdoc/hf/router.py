"""The MoE router's auxiliary load-balancing loss under CP, from the statistics of the WHOLE sequence.

transformers' causal MoE models (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Jamba, Granite-MoE, DBRX, JetMoE, PhiMoE,
MiniMax, ERNIE-4.5-MoE, FlexOlmo, Qwen3-Next, ...: every `load_balancing_loss_func` in the installed transformers
but Doge's product-key variant) share one Switch-Transformer loss: over all MoE layers and (non-padding) tokens,

    aux = num_experts * sum_e (count_e / rows) * (prob_e / rows)

count_e: top-k assignments to expert e, prob_e: the sum of its softmax routing probabilities, rows: the tokens
(times layers). These are SUMS over tokens, so under CP each rank sums its own tokens, one all-reduce over the
CP group (`cp.sum`, differentiable) gives the whole sequence's, and `aux` is one process's. With labels, the
model's loss becomes this rank's share  ce_share + coef * aux / cp.size  (summed over the group: one process's
loss, gradients likewise); `output.aux_loss` is the global value, the same on every rank, for logging. Tokens
that count are one process's: cp.shard_batch's padding (to cp.multiple, and each padded row's pads, rolled to
its end) is left out by the real row lengths it passes (what transformers' attention_mask leaves out).

Only the CP group takes part (never the data-parallel group): each replica's loss is its own batch's, as under
DDP without CP.
"""

from __future__ import annotations

import sys

import torch

_STANDARD_FROM = "transformers.models.mixtral.modeling_mixtral"  # the shared loss, as Mixtral defines it


def _function(hf):
    return getattr(sys.modules.get(type(hf).__module__), "load_balancing_loss_func", None)


def _same_code(a, b) -> bool:
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return ca is not None and cb is not None and ca.co_code == cb.co_code and ca.co_names == cb.co_names


def _text_attr(hf, name: str):
    value = getattr(hf, name, None)
    if value is None:
        text = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
        value = getattr(text, name, None)
    return value


def computes_aux(hf) -> bool:
    """Does this model's forward compute a router auxiliary loss at all?"""
    return _function(hf) is not None


def problem(hf) -> tuple[str, str] | None:
    """(feature, fix) when the model computes a router auxiliary loss longdoc does not reproduce, else None."""
    fn = _function(hf)
    if fn is None:
        return None
    import importlib

    standard = importlib.import_module(_STANDARD_FROM).load_balancing_loss_func
    if not _same_code(fn, standard):
        return (f"an MoE router auxiliary loss of its own ({type(hf).__module__}.load_balancing_loss_func, not "
                f"the shared Switch-Transformer loss)", "call the model with output_router_logits=False (and set "
                "config.output_router_logits = False)")
    if not isinstance(_text_attr(hf, "num_experts"), int) or not isinstance(_text_attr(hf, "num_experts_per_tok"), int):
        return ("an MoE router auxiliary loss whose expert counts longdoc cannot read (num_experts / "
                "num_experts_per_tok)", "call the model with output_router_logits=False")
    return None


def _keep(handle, n_rows: int, local_len: int, device) -> torch.Tensor | None:
    """(batch * local_len,) float32: 1 for this rank's tokens that count (real), 0 for padding; None: all count."""
    lengths = handle.row_lengths
    if lengths is None:
        return None
    cp = handle.cp
    docs = handle.documents
    rows = []
    for b, n in enumerate(lengths.tolist()):
        pos = cp.positions(local_len * cp.size, device=device, documents=docs[b] if docs is not None else None)
        rows.append((pos < n).float())
    keep = torch.stack(rows)
    if keep.numel() != n_rows:
        raise RuntimeError(f"longdoc.patch: {n_rows} router rows for {keep.numel()} tokens; the MoE router "
                           f"auxiliary loss cannot be computed from these router logits")
    return keep.reshape(-1)


def global_aux(hf, handle, router_logits: tuple[torch.Tensor, ...], local_len: int) -> torch.Tensor:
    """The auxiliary loss of the whole sequence (identical on every CP rank), differentiable."""
    num_experts, top_k = _text_attr(hf, "num_experts"), _text_attr(hf, "num_experts_per_tok")
    device = router_logits[0].device
    keep = _keep(handle, router_logits[0].shape[0], local_len, device)
    if keep is None:
        keep = torch.ones(router_logits[0].shape[0], dtype=torch.float32, device=device)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for gate in router_logits:  # the same arithmetic as transformers' function, summed over this rank's tokens
        weights = torch.nn.functional.softmax(gate.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
            0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        probs = probs + (weights.float() * keep.unsqueeze(-1)).sum(dim=0)
        rows = rows + keep.sum()
    cp = handle.cp
    totals = cp.sum(torch.cat([counts, rows.view(1)]).detach())  # counts and rows carry no gradient
    probs = cp.sum(probs)
    counts, rows = totals[:-1], totals[-1]
    return torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * num_experts


def coefficient(hf) -> float:
    return float(_text_attr(hf, "router_aux_loss_coef") or 0.0)
