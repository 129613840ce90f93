"""The layers of a config beyond a Llama layer, as the planner sees them: each layer's sequence mixer (attention,
Mamba2, Gated DeltaNet, or a kind not modelled) and MLP (dense, MoE or none), and the shapes of the MoE experts, the
recurrent mixers, MLA and the DSA indexer (longdoc.plan.layer_activations prices them; longdoc.plan.shapes reads
them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def get(cfg, *names: str, default: Any = None) -> Any:
    """The first of the config's fields `names` that is set (not None), else `default`."""
    for n in names:
        value = getattr(cfg, n, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """Routed experts (and shared ones) of a MoE MLP, as `longdoc.plan.layer_activations` prices them."""

    experts: int
    top_k: int
    width: int  # one expert's intermediate size
    shared: int = 0  # the shared experts' total intermediate size (0: none)
    # "softmax": softmax over the experts, then top-k (Mixtral, Qwen-MoE); "topk_softmax": top-k of the logits, then a
    # softmax over them (Granite); "sigmoid_group": sigmoid scores, top groups, then top-k (DeepSeek-V3, GLM-4.5)
    router: str = "softmax"
    renorm: bool = True  # the top-k weights divided by their sum (norm_topk_prob)
    shared_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE, Qwen3-Next)
    groups: int = 1  # sigmoid_group: expert groups, and the groups kept
    topk_groups: int = 1
    # tensors of the expert width the activation and the gate product keep: act and product (SiLU-gated), 5 for
    # GPT-OSS's clamped SwiGLU (sigmoid, gate, glu, up + 1, product); and a routed copy's bias index (GPT-OSS)
    act_saves: int = 2
    biased: bool = False


@dataclass(frozen=True, kw_only=True)
class Mamba2Shape:
    """A Mamba2 (SSD) mixer: heads x head_dim channels, a state of `state` per channel, B and C shared by `groups`."""

    heads: int
    head_dim: int
    state: int
    groups: int
    conv_kernel: int
    chunk: int

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # x, B and C pass the causal conv
        return self.inner + 2 * self.groups * self.state

    @property
    def proj(self) -> int:  # in_proj's output: the gate z, x, B, C and dt
        return 2 * self.inner + 2 * self.groups * self.state + self.heads


@dataclass(frozen=True, kw_only=True)
class DeltaShape:
    """A Gated DeltaNet mixer: q/k heads of k_dim, value heads of v_dim (each value head has a k_dim x v_dim state)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    chunk: int = 64  # transformers' torch_chunk_gated_delta_rule default, which the models call

    @property
    def conv_dim(self) -> int:  # q, k and v pass the causal conv
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True, kw_only=True)
class MlaShape:
    """DeepSeek's multi-head latent attention: low-rank q and kv, RoPE on `rope` of each head's dims."""

    q_lora: int | None  # None: q_proj straight from the hidden state
    kv_lora: int
    nope: int
    rope: int
    v_dim: int


@dataclass(frozen=True, kw_only=True)
class IndexerShape:
    """DeepSeek's sparse attention (DSA) indexer: each query keeps the `topk` keys it scores highest."""

    topk: int
    heads: int
    head_dim: int


ATTENTION_LAYER_TYPES = frozenset({"attention", "full_attention", "sliding_attention", "chunked_attention",
                                   "global_attention", "local_attention", "sliding_window_attention", "hybrid",
                                   "indexed_attention"})


# priced by longdoc.plan.layer_activations; other kinds as attention
MODELLED_MIXERS = frozenset({"mamba2", "gated_deltanet"})
PURE_SSM = frozenset({"mamba2"})  # every block: a norm and the mixer, no MLP
# layer kinds the planner does not price yet, named in the plan's notes: one block per layer (a mixer, an MLP or MoE
# alone: NemotronH) and a Mamba2 mixer beside every attention (Falcon-H1)
UNPRICED = {"nemotron_h": "single-block layers (mamba, attention, mlp, moe)",
            "falcon_h1": "Mamba2 beside attention in every layer"}


def mamba2_shape(text) -> Mamba2Shape | None:
    """Granite 4.0-H / Bamba style (mamba_*) or Mamba2 / NemotronH style field names; None if neither."""
    heads = get(text, "mamba_n_heads", "mamba_num_heads")
    if heads is None and "mamba2" in text.model_type:
        heads = get(text, "num_heads")
    head_dim = get(text, "mamba_d_head", "mamba_head_dim", *(("head_dim",) if "mamba2" in text.model_type else ()))
    state = get(text, "mamba_d_state", "ssm_state_size", "state_size")
    if heads is None or head_dim is None or state is None:
        return None
    if head_dim == "auto":
        head_dim = int(get(text, "mamba_expand", "expand", default=2)) * int(text.hidden_size) // int(heads)
    return Mamba2Shape(heads=int(heads), head_dim=int(head_dim), state=int(state),
                       groups=int(get(text, "mamba_n_groups", "n_groups", default=1)),
                       conv_kernel=int(get(text, "mamba_d_conv", "conv_kernel", default=4)),
                       chunk=int(get(text, "mamba_chunk_size", "chunk_size", default=256)))


def delta_shape(text) -> DeltaShape | None:
    k_heads = get(text, "linear_num_key_heads")
    if k_heads is None or get(text, "linear_key_head_dim") is None:
        return None
    return DeltaShape(k_heads=int(k_heads), v_heads=int(get(text, "linear_num_value_heads", default=k_heads)),
                      k_dim=int(text.linear_key_head_dim),
                      v_dim=int(get(text, "linear_value_head_dim", default=text.linear_key_head_dim)),
                      conv_kernel=int(get(text, "linear_conv_kernel_dim", default=4)))


def layer_kinds(text, mamba2: Mamba2Shape | None, delta: DeltaShape | None) -> tuple[str, ...]:
    """Each layer's mixer: attention, mamba2 or gated_deltanet where the config's fields say so, else its name."""
    types = get(text, "layer_types", "layers_block_type")
    if not isinstance(types, (list, tuple)) or not types or text.model_type in UNPRICED:
        return ()
    out = []
    for t in (str(t) for t in types):
        if t in ATTENTION_LAYER_TYPES:
            out.append("attention")
        elif mamba2 is not None and t in ("mamba", "mamba2", "linear_attention"):
            out.append("mamba2")
        elif delta is not None and t == "linear_attention":
            out.append("gated_deltanet")
        else:
            out.append(t)
    return tuple(out) if len(out) == int(text.num_hidden_layers) else ()


def moe_shape(text) -> MoeShape | None:
    top_k = get(text, "num_experts_per_tok")
    experts = get(text, "num_experts", "num_local_experts", "n_routed_experts")
    if top_k is None or not experts:
        return None
    width = int(get(text, "moe_intermediate_size", "intermediate_size"))
    shared = get(text, "shared_expert_intermediate_size", "shared_intermediate_size")
    if shared is None and get(text, "n_shared_experts"):
        shared = int(text.n_shared_experts) * width
    if get(text, "n_group") is not None or get(text, "topk_group") is not None:
        router = "sigmoid_group"
    elif text.model_type.startswith(("granitemoe", "gpt_oss")):
        router = "topk_softmax"
    else:
        router = "softmax"
    renorm = bool(get(text, "norm_topk_prob", default=text.model_type in ("mixtral", "granitemoehybrid")))
    return MoeShape(experts=int(experts), top_k=int(top_k), width=width, shared=int(shared or 0), router=router,
                    renorm=renorm, shared_gate=bool(shared) and text.model_type.startswith(("qwen2_moe", "qwen3_next",
                                                                                           "qwen3_5")),
                    groups=int(get(text, "n_group", default=1)), topk_groups=int(get(text, "topk_group", default=1)),
                    act_saves=5 if text.model_type == "gpt_oss" else 2, biased=text.model_type == "gpt_oss")


def mlp_kinds(text, moe: MoeShape | None) -> tuple[str, ...]:
    """Each layer's MLP: "moe" or "dense" (mlp_layer_types, first_k_dense_replace, decoder_sparse_step /
    mlp_only_layers); () when every layer has the same one."""
    if moe is None:
        return ()
    n = int(text.num_hidden_layers)
    types = get(text, "mlp_layer_types")
    if isinstance(types, (list, tuple)) and len(types) == n:
        return tuple("dense" if str(t) == "dense" else "moe" for t in types)
    first = get(text, "first_k_dense_replace")
    if first is not None:
        freq = int(get(text, "moe_layer_freq", default=1))
        return tuple("moe" if j >= int(first) and j % freq == 0 else "dense" for j in range(n))
    step, only = get(text, "decoder_sparse_step"), set(get(text, "mlp_only_layers", default=()) or ())
    if step is not None or only:
        step = int(step or 1)
        return tuple("moe" if j not in only and (j + 1) % step == 0 else "dense" for j in range(n))
    return ()
