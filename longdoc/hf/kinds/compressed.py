"""Sparse attention variants longdoc has no CP route for yet, refused by name before anything runs: DeepSeek-V4's
compressed attention layers (compressed_sparse_attention, heavily_compressed_attention), and the pooled / QSA
indexers of GLM-5-Next and Qwen4-Exp.

Each such layer attends over two key sets: the sliding window of raw tokens, and entries compressed from windows
of m consecutive tokens (m = 4 for CSA, whose entries also overlap the previous window; m = 128 for HCA), which a
lightning indexer top-k's per query (CSA) under a causal threshold, all in one attention call with an additive
bias over the concatenated keys. Under CP the windows cross rank boundaries and the compressed keys are global,
so the layer needs its compressor run over gathered window inputs and an attention over two key sets with
different masks merged by log-sum-exp. That route is not built; until it is, the layers are refused here, by
name and before anything runs, rather than computed on each rank's tokens alone.

GLM-5-Next's indexer scores pools of index_kpool consecutive keys (gated averages, counted from the first real
token) and adds each query's incomplete tail pool, then hands the attention a dense (S x T) mask it builds
itself; Qwen4-Exp's QSA indexer pools blocks of each query's own visible keys and returns a dense selection
mask that its attention ANDs with the causal mask. Both are exact in principle under CP (the pools are small
and global), but their mask-building code needs routes of its own; not built.
"""

from __future__ import annotations

from longdoc.hf.kinds.registry import Refused, register

_COMPRESSORS = frozenset({"DeepseekV4CSACompressor", "DeepseekV4HCACompressor"})
_POOLED = {"Glm5NextTextIndexer": "GLM-5-Next's pooled DSA indexer (top-k over gated pools of index_kpool keys "
                                  "plus each query's tail, turned into a dense mask by its attention)",
           "Qwen4ExpTextQSAIndexer": "Qwen4-Exp's QSA indexer (top-k over pooled blocks of each query's visible "
                                     "keys, returned as a dense selection mask)"}


def _refused(module, handle) -> tuple[str, str]:
    if type(module).__name__ in _POOLED:
        return f"{_POOLED[type(module).__name__]}: not built under CP yet", "run this model without CP"
    which = "compressed sparse" if type(module).__name__ == "DeepseekV4CSACompressor" else "heavily compressed"
    return (f"DeepSeek-V4 {which} attention (attention over a second key set, compressed from windows of tokens "
            f"that cross CP ranks, beside the sliding window: not built under CP yet)", "run this model without CP")


KIND = register(Refused(
    name="deepseek_v4_compressed",
    layer_types=frozenset({"compressed_sparse_attention", "heavily_compressed_attention", "indexed_attention"}),
    matches=lambda m: type(m).__name__ in _COMPRESSORS or type(m).__name__ in _POOLED,
    problem=_refused,
))
