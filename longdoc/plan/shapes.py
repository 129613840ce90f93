"""The shape of a causal LM as the planner sees it, from a config alone (no weights).

    shape = model_shape("Llama-3.1-8B")            # data/configs/*.json, a folder, a config.json, a hub id,
    shape = model_shape("tiny:llama")              # "tiny:<arch>", or SmolLM2-135M-Instruct
    shape.params.total                              # 8_030_261_248

Parameter counts come from the model built on PyTorch's meta device (exact for any architecture
transformers knows, and nothing is allocated). For a Llama-shaped model they equal the formula a
reader can check by hand (tested for the configs in data/configs):

    per layer  = h*q + 2*h*kv + q*h        (q, k, v, o projections; q = heads*head_dim, kv = kv_heads*head_dim)
               + 3*h*I                     (gate, up, down)
               + 2*h                       (two RMSNorm weights)
    total      = layers * per_layer + V*h (embedding) + V*h (lm_head, unless tied) + h (final norm)

Llama-3.1-8B: 32 * 218,112,000 + 2 * 525,336,576 + 4,096 = 8,030,261,248.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from longdoc.plan.layer_shapes import (  # noqa: F401 - ATTENTION_LAYER_TYPES, the sub-shapes re-exported
    ATTENTION_LAYER_TYPES,
    MODELLED_MIXERS,
    PURE_SSM,
    UNPRICED,
    DeltaShape,
    IndexerShape,
    Mamba2Shape,
    MlaShape,
    MoeShape,
    delta_shape,
    get,
    layer_kinds,
    mamba2_shape,
    mlp_kinds,
    moe_shape,
)
from longdoc.runtime.resources import resource_dir

CONFIG_DIR = resource_dir("configs")  # data/configs in a checkout, a bundled copy in a wheel


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    embed: int  # input embedding
    head: int  # lm_head (0 when tied to the embedding)
    layer: int  # one decoder layer (the largest, if they differ)
    layers: int  # all decoder layers
    other: int  # final norm and anything else outside the layers

    @property
    def total(self) -> int:
        return self.embed + self.head + self.layers + self.other

    @property
    def matmul(self) -> int:
        """Parameters used in a matmul per token (every weight but the embedding lookup and norms)."""
        return self.layers + self.head + (self.embed if self.head == 0 else 0)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    model_type: str
    hidden: int  # h
    intermediate: int  # I: MLP width a token passes through (for MoE: experts per token * expert width + shared)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # V
    tied: bool
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3, OLMo-2)
    layernorm: bool  # LayerNorm (StableLM, GPT-NeoX) instead of RMSNorm
    fused_qkv: bool  # one qkv projection whose output v keeps alive (Phi-3)
    rotary_dim: int  # head dims RoPE rotates (partial rotary: fewer)
    moe: bool
    max_positions: int
    params: ParamCount
    # layer kinds other than attention that the config names (hybrids: "mamba", "linear_attention", ...), and
    # whether attention is DeepSeek's sparse indexed kind: the memory model prices every layer as an attention layer
    mixers: tuple[str, ...] = ()
    sparse: bool = False
    # per layer: its sequence mixer ("attention", "mamba2", "gated_deltanet", or the config's name of a kind the
    # planner does not model, priced as attention) and its MLP ("dense" or "moe"); () for a uniform Llama-style stack
    layer_kinds: tuple[str, ...] = ()
    mlp_kinds: tuple[str, ...] = ()
    experts: MoeShape | None = None
    mamba2: Mamba2Shape | None = None
    delta: DeltaShape | None = None
    mla: MlaShape | None = None
    indexer: IndexerShape | None = None
    attn_gate: bool = False  # a sigmoid gate on the attention output, from a q_proj of twice the width (Qwen3-Next)
    # RMSNorms that scale in fp32 and cast after ((x * w).to(dtype): Gemma, Qwen3-Next, GPT-OSS, OLMo-2) keep the
    # fp32 normalised x, where Llama's w * x.to(dtype) keeps it in the activation dtype
    norm_fp32: bool = False
    dense_intermediate: int = 0  # the dense MLPs' width where a MoE model has some (DeepSeek's first layers)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def with_layers(self, layers: int) -> ModelShape:
        """The same model at another depth (every layer the size of its largest one): the benchmarks run reduced
        depths and the planner carries their per-layer terms to the full depth."""
        if layers == self.layers:
            return self
        params = dataclasses.replace(self.params, layers=self.params.layer * layers)
        cycle = {k: tuple(v[i % len(v)] for i in range(layers)) for k in ("layer_kinds", "mlp_kinds")
                 if (v := getattr(self, k))}
        return dataclasses.replace(self, name=f"{self.name} ({layers} layers)", layers=layers, params=params, **cycle)

    def mixer(self, layer: int) -> str:
        """The sequence mixer of decoder layer `layer` ("attention" unless the config says otherwise)."""
        return self.layer_kinds[layer] if self.layer_kinds else "attention"

    def mlp(self, layer: int) -> str:
        """The MLP of decoder layer `layer`: "moe", "dense" or "none" (a pure SSM's block)."""
        if self.mlp_kinds:
            return self.mlp_kinds[layer]
        return "moe" if self.experts is not None else "dense"

    @property
    def attention_layers(self) -> int:
        """Layers whose mixer is attention (or a kind priced as attention): the ones with CP attention."""
        return sum(1 for j in range(self.layers) if self.mixer(j) not in MODELLED_MIXERS)


def _resolve_config(name_or_path: str):
    from longdoc import models

    path = Path(name_or_path).expanduser()
    if path.is_file() or path.is_dir() or name_or_path.startswith(models.TINY_PREFIX):
        return models.load_config(str(path) if path.is_file() else name_or_path)
    known = {p.stem.lower(): p for p in CONFIG_DIR.glob("*.json")}
    key = name_or_path.rsplit("/", 1)[-1].lower()
    for candidate in (key, key.removesuffix("-instruct")):
        if candidate in known:
            return models.load_config(str(known[candidate]))
    try:
        return models.load_config(name_or_path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot find a config for {name_or_path!r}: {err}. Offline, pass a config.json or a model folder, "
            f"'tiny:<arch>', or one of the published configs in {CONFIG_DIR}: "
            f"{', '.join(sorted(p.stem for p in known.values()))}") from err


@functools.lru_cache(maxsize=32)
def _count_params(config_json: str) -> ParamCount:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):  # shapes only: a 70B model costs nothing here
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    head = 0 if out is None or out.weight is embed else out.weight.numel()
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers"):  # Llama 4's text model answers get_decoder() with itself
        decoder = model.model
    layer_sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder.layers]
    total = sum(p.numel() for p in model.parameters())
    return ParamCount(embed=embed.numel(), head=head, layer=max(layer_sizes), layers=sum(layer_sizes),
                      other=total - embed.numel() - head - sum(layer_sizes))


def _partial_rotary(text) -> float:
    rope = getattr(text, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(factor or get(text, "partial_rotary_factor", default=1.0))


def _rope(text) -> bool:
    """False where the config opts out of RoPE (Granite 4.0-H's position_embedding_type None: no cos/sin at all)."""
    return getattr(text, "position_embedding_type", "rope") in ("rope", "rotary")


def _mixers(text) -> tuple[str, ...]:
    """The config's non-attention layer kinds (`layer_types`, `layers_block_type`, or a pure SSM's model type)."""
    types = get(text, "layer_types", "layers_block_type") or []
    kinds = sorted({str(t) for t in types if isinstance(t, str)} - ATTENTION_LAYER_TYPES)
    if not kinds and any(k in text.model_type for k in ("mamba", "rwkv", "xlstm")):
        kinds = [text.model_type]
    return tuple(kinds)


def shape_from_config(config, name: str = "") -> ModelShape:
    """A ModelShape from a transformers config (text part of multimodal configs)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, heads = int(text.hidden_size), int(text.num_attention_heads)
    head_dim = int(get(text, "head_dim", default=h // heads))
    experts = moe_shape(text)
    # a pure SSM's block is one norm and the mixer, no MLP (Mamba2Block)
    mlps = ("none",) * int(text.num_hidden_layers) if text.model_type in PURE_SSM else mlp_kinds(text, experts)
    moe = experts is not None
    dense = int(text.intermediate_size) if (not moe and text.model_type not in PURE_SSM) or "dense" in mlps else 0
    # the MLP width a token passes through: the active experts' (k * expert width + shared), or the dense MLPs'
    width = max(experts.top_k * experts.width + experts.shared, dense) if experts is not None else dense
    mamba2, delta = mamba2_shape(text), delta_shape(text)
    q_lora = get(text, "q_lora_rank")
    mla = MlaShape(q_lora=None if q_lora is None else int(q_lora), kv_lora=int(text.kv_lora_rank),
                   nope=int(text.qk_nope_head_dim), rope=int(text.qk_rope_head_dim), v_dim=int(text.v_head_dim)) \
        if get(text, "kv_lora_rank") is not None and get(text, "qk_nope_head_dim") is not None else None
    kv_heads = int(get(text, "num_key_value_heads", default=heads))
    rotary = int(head_dim * _partial_rotary(text)) // (2 if text.model_type == "gpt_oss" else 1)  # its cos/sin: d/2
    if mla is not None:  # q, k and v are attended (and travel) at one head width, K/V expanded to every head
        head_dim, kv_heads, rotary = max(mla.nope + mla.rope, mla.v_dim), heads, mla.rope
    kinds = layer_kinds(text, mamba2, delta)
    if not _rope(text) or all(k in MODELLED_MIXERS for k in kinds or ("attention",)):
        rotary = 0  # no RoPE, or no attention layer (a pure SSM): no cos/sin
    topk = get(text, "index_topk")
    indexer = IndexerShape(topk=int(topk), heads=int(get(text, "index_n_heads", default=64)),
                           head_dim=int(get(text, "index_head_dim", default=128))) if topk is not None else None
    fields = {k: v for k, v in text.to_dict().items() if not k.startswith("_")}
    fields["model_type"] = text.model_type
    params = _count_params(json.dumps(fields, sort_keys=True, default=str))
    return ModelShape(
        name=name or getattr(text, "_name_or_path", "") or text.model_type,
        model_type=text.model_type, hidden=h, intermediate=width, layers=int(text.num_hidden_layers),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(text.vocab_size), tied=params.head == 0,
        qk_norm=text.model_type in ("qwen3", "qwen3_moe", "olmo2", "qwen3_next", "qwen3_5", "qwen3_5_text",
                                    "qwen3_5_moe", "qwen3_5_moe_text"),
        layernorm=getattr(text, "rms_norm_eps", None) is None and getattr(text, "layer_norm_eps", None) is not None,
        fused_qkv=text.model_type in ("phi3",),
        rotary_dim=rotary, moe=moe,
        max_positions=int(get(text, "max_position_embeddings", default=0)), params=params,
        mixers=(UNPRICED[text.model_type],) if text.model_type in UNPRICED else _mixers(text),
        sparse=indexer is not None, layer_kinds=kinds,
        mlp_kinds=mlps, experts=experts, mamba2=mamba2, delta=delta, mla=mla, indexer=indexer,
        attn_gate=bool(get(text, "attn_output_gate", default=text.model_type.startswith(("qwen3_next", "qwen3_5")))),
        dense_intermediate=dense if moe else 0,
        norm_fp32=text.model_type.startswith(("gemma", "qwen3_next", "qwen3_5", "gpt_oss", "olmo2")),
    )


def model_shape(name_or_path: str) -> ModelShape:
    """The shape of a model by name, published config, folder, config.json, hub id or "tiny:<arch>"."""
    return shape_from_config(_resolve_config(name_or_path), name=name_or_path)


def lora_params_per_layer(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA A (r x in) + B (out x r) for each targeted projection of one layer."""
    h, q, kv, i = shape.hidden, shape.q, shape.kv, shape.intermediate
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not modelled by the planner; use among {', '.join(dims)}")
    return sum(rank * (a + b) for a, b in (dims[t] for t in targets))

