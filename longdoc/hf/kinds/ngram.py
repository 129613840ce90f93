"""Qwen4-exp's per-layer n-gram embedding (PLE): refused by name under CP.

Each PLE layer hashes every token id with the ngram_size - 1 ids before it (resetting after an EOS token) and
adds a dilated causal convolution over the residual streams: both need tokens from the rank before (a token
halo for the ids, a (kernel - 1) x dilation halo for the conv) that no route gives them yet. Matched explicitly
so that the refusal names the feature instead of a bare Conv1d.
"""

from __future__ import annotations

from longdoc.hf.kinds.registry import Refused, register


def _problem(module, handle) -> tuple[str, str]:
    n = getattr(getattr(module, "ple_embedding", None), "ngram_size", "?")
    return (f"Qwen4-exp's n-gram embedding (PLE layers: every token hashed with the {n} - 1 token ids before it, "
            f"then a dilated causal convolution), which needs a token halo under CP",
            "configure the model without PLE layers (ple_layer_ids=[]) or run it without CP")


KIND = register(Refused(name="ngram_embedding", matches=lambda m: type(m).__name__ == "Qwen4ExpTextPLELayer",
                        problem=_problem))
