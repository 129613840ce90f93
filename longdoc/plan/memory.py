"""Per-rank peak memory of one training step under context parallelism, term by term.

Notation (every term below is in bytes; README "Planning" works an example by hand):
  L sequence length, padded to the layout's multiple (2*cp zigzag, cp contiguous); B micro-batch;
  N = B*L/cp tokens per rank; h hidden, I MLP width, q = heads*head_dim, kv = kv_heads*head_dim,
  nh heads, V vocabulary, n layers; c bytes per activation (2 bf16 on GPU and under CPU autocast, 4 fp32 on
  CPU); r bytes of the residual stream, norms and cos/sin (= c, except 4 under CPU autocast); w bytes of a
  frozen weight (2 on GPU, 4 on CPU: autocast keeps the weights fp32);
  P parameters, P_t trainable ones, P_l one layer, P_root = embedding + lm_head + final norm;
  S ranks sharing parameters (dp*cp under FSDP2, 1 otherwise); C = loss chunk tokens (N: no chunking).

State (present all step):      weights P*4/S (LoRA: frozen base P*w, adapters *4); AdamW 2*P_t*4/S
Gradients (backward on):       P_t*4/S; + DDP bucket copy P_t*4 when DDP (world > 1, no FSDP), all step
                               (resident from the 3rd step: DDP rebuilds its buckets in the 2nd; a run of
                               Setup.steps <= 2 is planned without them)
Saved activations, per token and layer, of an HF Llama-style layer (counted with saved-tensor hooks in
the tests):  A = 2*(4h + 4 + 2ch) [two RMSNorms: fp32 input, rsqrt, normed, out] + c*(3q + 2kv) [q, k
after RoPE, v, attention out, o_proj input] + 4nh [lse] + 4cI [gate, up, act, product]; Qwen3's q/k
norms add 4(q+kv) + 4(nh+nkv) + c(q+kv); LayerNorm keeps (ch + 8) + ch per norm; Phi-3's fused qkv
output stays whole, + c(q+kv); Gemma / Qwen3-Next / GPT-OSS / OLMo-2 norms keep their normed x in fp32 (4h, not ch).
LoRA (frozen base): frozen linears keep no input, see `layer_bytes_per_token`. Other layer kinds (Mamba2 and Gated
DeltaNet mixers, MoE, MLA, DSA) replace A's attention or MLP part with their own terms per layer, A_j
(longdoc.plan.layer_activations); DSA adds forward temporaries (the indexer's keys of the whole sequence, one score
tile) and a selected-key mask tile to the attention backward.
Shared by all layers: RoPE cos/sin 2*N*rotary_dim*c. After the last layer: final norm + the loss tokens'
hidden states N*(4h + 4 + 3ch).
Activation checkpointing (per decoder layer): n*N*h*c checkpoints + one layer's A*N while it is
recomputed in the backward (in fp32 its first norm's input IS the checkpoint: N*h*4 less); without it n*N*A.
Loss: cross-entropy over C tokens at a time: 12*C*V (fp32 log-probs + their gradient + the logits
gradient, the backward peak; bf16 logits are cast to fp32 first). Without chunking C = N.
Backward temporaries of one layer: the MLP's 2cNI + 2cNh (gradients of product/act/up, less the saved product
down_proj's backward freed; residual stream; LoRA with a frozen down_proj saves no product: 3cNI + 2cNh),
or, once the MLP's own saved 4cNI (LoRA: 3cNI) are freed, the attention's dQ fp32 4Nq + block dQ and dout copy 2cNq
+ the communication buffers: whichever is larger.
Communication buffers: ring: K/V double buffer 2*(2*N*kv*c) + fp32 dK/dV in flight (1 for cp=1, 3 in
the ring: being sent, being received, accumulating) * 2*N*kv*4. All-gather: full K/V cp*2*N*kv*c twice
(parts + ordered copy) + fp32 dK/dV for the whole sequence and its reduce-scatter parts 2*cp*2*N*kv*4.
Ulysses / usp: the q/k/v gradients in token and head layout with their all-to-all copies, and usp's outer
ring buffers over U*N tokens (longdoc/plan/strategies.py `buffers`).
FSDP2 buffers (f bytes per gathered parameter: c on GPUs, FSDP2's bf16 mixed precision; 4 on CPU, where
fully_shard gathers the fp32 weights): forward 2*P_l*f (current + prefetched layer), backward P_l*(3f + 4) (two
layers of params, the unsharded gradient and its fp32 reduce copy); the root unit (embedding, lm_head, norm) stays
unsharded from forward to the end of backward: P_root*f, + its lm_head gradient P_head*f; in the loss's backward
the last layer's all-gather output P_l*f (the root's pre-backward prefetches it at the first backward op; it is
copied out and freed only when that layer's backward starts, after every loss chunk).
CPU bf16 autocast (weights fp32, c = 2 for matmul outputs): the residual stream, the norms and RoPE's cos/sin
stay fp32 (r = 4 where the text above says c), a norm's output is not kept, and each trainable linear reading it
keeps its own bf16 copy c*h (3 for q/k/v, 2 for gate/up; fused projections one); autocast's bf16 weight
copies: P_mm*c cached through the forward (full fine-tuning), saved per layer P_l*c for the backward.
Optimizer step: + AdamW temporaries: foreach on GPU P_t*4/S; per-tensor on CPU 2*(largest tensor)*4.
Checkpoint offload (GPU): the device keeps 2*N*h*r of the checkpoints (the layer recomputed and the one fetched
ahead), the rest lives in pinned host memory (a note); on a CPU the host is the device and nothing changes.
Tiled MLP (T = tile tokens, the hidden size by default): A without the MLP's 4cI (the MLP saves its input only,
`activations.layer_bytes_per_token`); forward temporaries 3cTI; backward 6cTI + 2rNh (one tile recomputed with
grad beside the whole input gradient); nothing of the MLP is freed before the attention's backward.

The step's peak is the largest of four phases, each a sum of the terms live at that moment:
  forward   state + DDP buckets + n checkpoints + a layer's forward temporaries (3*c*N*I: gate, up, act)
  loss      state + DDP buckets + n checkpoints (or n*A*N) + final-norm/loss inputs + 12*C*V + lm_head grads
            + FSDP's root unit and the last layer prefetched for the backward
  backward  state + grads of the layers above + checkpoints of the layers below + A*N + the layer's
            backward temporaries + FSDP buffers (the worst layer: usually the last, at large cp the first)
  optimizer state + all grads + DDP buckets + AdamW temporaries
plus the runtime (CUDA context + NCCL, or the Python process) and allocator slack on the short-lived part.
"""

from __future__ import annotations

from dataclasses import dataclass

from longdoc.parallel.selection import MASK_ELEMENTS
from longdoc.plan import layer_activations, memory_notes, strategies
from longdoc.plan.activations import LORA_TARGETS, layer_bytes_per_token, layer_parts_per_token  # noqa: F401
from longdoc.plan.hardware import GIB
from longdoc.plan.setups import CATEGORIES, MemoryEstimate, Setup, Term  # noqa: F401 - re-exported
from longdoc.plan.shapes import MODELLED_MIXERS, lora_params_per_layer


def _comm_buffers(s: Setup) -> tuple[float, str]:
    sh = s.shape
    return strategies.buffers(s.strategy, cp=s.cp, ulysses=s.ulysses_size, tokens=s.tokens, q_heads=sh.heads,
                              kv_heads=sh.kv_heads, head_dim=sh.head_dim, c=s.c)


def _residual(s: Setup) -> tuple[int, str]:
    """r, bytes of the residual stream, norms and cos/sin (fp32 under CPU autocast: fp32 embeddings, fp32 adds), and
    the symbol the formulas print for it."""
    return (4, "r") if s.dev.autocast else (s.c, "c")


def _gathered(s: Setup) -> int:
    """f, bytes of a gathered parameter and its unsharded gradient: FSDP2's bf16 mixed precision on GPUs; on CPU
    longdoc's fully_shard has no mixed-precision policy, so it gathers the fp32 weights (the autocast casts follow)."""
    return s.c if s.dev.is_gpu else 4


def estimate(s: Setup) -> MemoryEstimate:
    """Every phase's live terms, and which phase is the peak."""
    live = _Live.of(s)
    phases = {"forward": _forward(s, live), "loss": _loss(s, live), "backward": _backward(s, live),
              "optimizer": [*live.state, Term("gradients", "grads", f"P_t*4/S = {s.trainable:,}*4/{s.shards}",
                                              s.trainable * 4 / s.shards), _adam_temporaries(s)]}
    dev = s.dev
    runtime = Term("runtime", "runtime", f"{dev.name}: {dev.runtime_gib} GiB", dev.runtime_gib * GIB)
    for terms in phases.values():
        short = sum(t.bytes for t in terms if t.category in ("activations", "loss", "comm_buffers", "fsdp_buffers"))
        terms.append(runtime)
        if dev.slack:
            terms.append(Term("allocator slack", "slack", f"{dev.slack:g} x short-lived bytes", dev.slack * short))
    peak = max(phases, key=lambda k: sum(t.bytes for t in phases[k]))
    return MemoryEstimate(setup=s, phases=phases, peak_phase=peak, notes=memory_notes.notes(s, _kinds_priced(s.shape)))


@dataclass(frozen=True)
class _Live:
    """The terms several phases of one step hold: the state (weights, AdamW moments, DDP buckets), RoPE's cos/sin,
    the FSDP root unit, the lm_head gradient, and what the layers keep for their backward."""

    s: Setup
    state: list[Term]
    rotary: Term
    fsdp_root: list[Term]
    head_grad: Term | None  # None: nothing trains the lm_head (LoRA)
    a_tok: float  # A: bytes a Llama-style layer saves per token
    per_layer: list[float]  # bytes each layer saves on this rank (kinds: longdoc.plan.layer_activations)
    uniform: bool  # every layer is a Llama-style one (A*N)

    @classmethod
    def of(cls, s: Setup) -> _Live:
        sh, dev, S = s.shape, s.dev, s.shards
        p, p_t, wb = sh.params.total, s.trainable, dev.weight_bytes
        r, rs = _residual(s)
        if s.lora:
            weights = Term("weights", "weights", f"P*w + P_t*4 = {p:,}*{wb} + {p_t:,}*4", p * wb + p_t * 4)
        else:
            weights = Term("weights", "weights", f"P*4/S = {p:,}*4/{S}", p * 4 / S)
        state = [weights, Term("AdamW moments", "optimizer", f"2*P_t*4/S = 2*{p_t:,}*4/{S}", 2 * p_t * 4 / S)]
        if s.ddp_buckets:
            state.append(Term("DDP gradient buckets", "grads", f"P_t*4 = {p_t:,}*4", p_t * 4))
        head_params = 0 if s.lora else (sh.params.head or sh.params.embed)
        f = _gathered(s)
        # lm_head gradient (tied: the embedding's): under FSDP it stays unsharded in the gathered dtype until the
        # root unit's backward ends; otherwise it is the fp32 gradient itself.
        hg = f if s.uses_fsdp else 4
        head_grad = Term("lm_head gradient", "fsdp_buffers" if s.uses_fsdp else "grads",
                         f"P_head*{'f' if s.uses_fsdp else 4} = {head_params:,}*{hg}", head_params * hg)
        fsdp_root = []
        if s.uses_fsdp:
            p_root = p - sh.params.layers  # not resharded after forward: gathered from forward to backward's end
            fsdp_root = [Term("FSDP root unit (embedding, lm_head, norm) gathered", "fsdp_buffers",
                              f"P_root*f = {p_root:,}*{f}", p_root * f)]
        n = s.tokens
        rotary = Term("rotary cos/sin", "activations", f"2*N*rotary_dim*{rs} = 2*{n:,}*{sh.rotary_dim}*{r}",
                      2 * n * sh.rotary_dim * r)
        a_tok = layer_bytes_per_token(sh, s.c, s.lora, s.lora_rank, s.lora_targets, autocast=dev.autocast,
                                      tiled_mlp=s.tiled_mlp)
        return cls(s=s, state=state, rotary=rotary, fsdp_root=fsdp_root, head_grad=head_grad if head_params else None,
                   a_tok=a_tok, per_layer=layer_saved_bytes(s), uniform=not _kinds_priced(sh))

    def saved(self, layers: int) -> Term:
        """What the first `layers` layers keep for their backward: their checkpoints, or their saved activations."""
        s, n, h = self.s, self.s.tokens, self.s.shape.hidden
        r, rs = _residual(s)
        if s.checkpointing and s.offloads:  # the layer being copied out / recomputed and the one fetched ahead
            k = min(layers, 2)
            return Term(f"checkpoints on the device ({k} of {layers} layers, the rest in host memory)", "activations",
                        f"{k}*N*h*{rs} = {k}*{n:,}*{h}*{r}", k * n * h * r)
        if s.checkpointing:
            return Term(f"checkpoints ({layers} layers)", "activations",
                        f"{layers}*N*h*{rs} = {layers}*{n:,}*{h}*{r}", layers * n * h * r)
        if self.uniform:
            return Term(f"saved activations ({layers} layers)", "activations",
                        f"{layers}*A*N = {layers}*{self.a_tok:,.0f}*{n:,}", layers * self.a_tok * n)
        return Term(f"saved activations ({layers} layers)", "activations",
                    _kinds_formula(s.shape, self.per_layer[:layers]), sum(self.per_layer[:layers]))


def _forward(s: Setup, live: _Live) -> list[Term]:
    """The forward of the last layer: every checkpoint + that layer's largest temporaries (gate, up, act)."""
    sh, c, t_mlp, f = s.shape, s.c, s.mlp_tokens, _gathered(s)
    tn = "T" if s.tiled_mlp else "N"  # the MLP's intermediates span one tile of T tokens when tiled
    terms = [*live.state, live.saved(sh.layers), live.rotary, *_autocast_weights(s)["forward"],
             Term("layer forward temporaries", "activations", f"3*c*{tn}*I = 3*{c}*{t_mlp:,}*{sh.intermediate:,}",
                  3 * c * t_mlp * sh.intermediate), *live.fsdp_root]
    if sh.indexer is not None:  # the indexer's keys of the whole sequence and one score tile (no_grad: not saved)
        keys = s.micro_batch * s.padded_len * sh.indexer.head_dim * c
        tile = layer_activations.DSA_SCORE_ELEMENTS
        terms.append(Term("DSA indexer: all index keys + one score tile", "activations",
                          f"B*L*d_idx*c + 4*S_tile = {s.micro_batch}*{s.padded_len:,}*{sh.indexer.head_dim}*{c} + "
                          f"4*{tile:,}", keys + 4 * tile))
    if s.uses_fsdp:
        terms.append(Term("FSDP layers gathered (current + prefetched)", "fsdp_buffers",
                          f"2*P_l*f = 2*{sh.params.layer:,}*{f}", 2 * sh.params.layer * f))
    return terms


def _loss(s: Setup, live: _Live) -> list[Term]:
    """The CE backward of the last loss chunk; earlier chunks' lm_head gradient exists already."""
    sh = s.shape
    terms = [*live.state, live.saved(sh.layers), live.rotary, *_autocast_weights(s)["loss"], _loss_inputs(s),
             Term("loss chunk (fp32 log-probs, their grad, logits grad)", "loss",
                  f"12*C*V = 12*{s.chunk:,}*{sh.vocab:,}", 12.0 * s.chunk * sh.vocab), *live.fsdp_root]
    if s.loss_chunk is not None and live.head_grad is not None:
        terms.append(live.head_grad)
    if s.uses_fsdp:  # measured: the last layer's all-gather output (P_l fp32 on CPU) is alive in every loss chunk
        p_l, f = sh.params.layer, _gathered(s)
        terms.append(Term("FSDP last layer gathered ahead of its backward (prefetch)", "fsdp_buffers",
                          f"P_l*f = {p_l:,}*{f}", p_l * f))
    return terms


def _backward(s: Setup, live: _Live) -> list[Term]:
    """The backward of the worst layer j (usually the last, at large cp the first): inputs of layers 0..j,
    gradients of the layers above, layer j's tensors."""
    sh = s.shape
    workspace = _backward_workspace(s)
    grad_layer = (lora_params_per_layer(sh, s.lora_rank, s.lora_targets) if s.lora else sh.params.layer) * 4 / s.shards
    return max((_backward_at(s, live, j, workspace, grad_layer) for j in range(sh.layers)),
               key=lambda ts: sum(t.bytes for t in ts))


def _backward_workspace(s: Setup) -> list[Term]:
    """A layer's backward temporaries: the MLP's, or the attention's workspace and the strategy's communication
    buffers, whichever is larger."""
    sh, c, n, t_mlp = s.shape, s.c, s.tokens, s.mlp_tokens
    h, i, q = sh.hidden, sh.intermediate, sh.q
    r, rs = _residual(s)
    # tiled: one tile recomputed with grad (its 4cTI saved + 2cTI gradients) beside the whole input gradient
    # untiled: the gradients of the product, act and up (3cNI) beside the saved gate, up and act; the product is
    # freed by then where down_proj saved it (a frozen down_proj under LoRA saves no input: nothing freed)
    product_saved = not s.lora or "down_proj" in s.lora_targets
    k_mlp = 6 if s.tiled_mlp else (2 if product_saved else 3)
    mlp_tmp = k_mlp * c * t_mlp * i + 2 * r * n * h
    mlp_formula = (f"6cTI + 2{rs}Nh = 6*{c}*{t_mlp:,}*{i:,} + 2*{r}*{n:,}*{h}" if s.tiled_mlp
                   else f"{k_mlp}cNI + 2{rs}Nh = {n:,}*({k_mlp}*{c}*{i} + 2*{r}*{h})")
    comm, comm_formula = _comm_buffers(s)
    # the MLP's saved part (4cNI; 3cNI without the product) is freed by then (tiled: it was never saved)
    freed = 0 if s.tiled_mlp else (4 if product_saved else 3) * c * n * i
    attn_tmp = 4 * n * q + 2 * c * n * q - freed
    if sh.indexer is not None:  # selected keys: one bool mask tile and the additive mask a kernel builds from it
        attn_tmp += MASK_ELEMENTS * (1 + c)
    if attn_tmp + comm > mlp_tmp:
        return [Term("attention backward workspace", "activations",
                     f"4Nq + 2cNq - freed MLP = {n:,}*(4*{q} + 2*{c}*{q}) - {freed:,}", attn_tmp),
                Term(f"{s.strategy} buffers", "comm_buffers", comm_formula, comm)]
    return [Term("tiled MLP backward (one tile)" if s.tiled_mlp else "MLP backward temporaries", "activations",
                 mlp_formula, mlp_tmp)]


def _backward_at(s: Setup, live: _Live, j: int, workspace: list[Term], grad_layer: float) -> list[Term]:
    """The terms live in layer j's backward."""
    sh, p_l = s.shape, s.shape.params.layer
    terms = [*live.state, live.saved(j + 1), live.rotary]
    if s.dev.autocast:
        layers = 1 if s.checkpointing else j + 1
        terms.append(Term(f"autocast bf16 weights saved ({layers} layers)", "activations",
                          f"{layers}*P_l*c = {layers}*{p_l:,}*{s.c}", layers * p_l * s.c))
    if s.checkpointing:  # layer j's saved tensors while its backward recomputes it from the checkpoint
        # In fp32 the first norm's saved input IS the checkpointed layer input: not counted twice.
        n, h = s.tokens, sh.hidden
        alias = n * h * 4 if _residual(s)[0] == 4 else 0
        if live.uniform:
            terms.append(Term("recomputed layer", "activations", f"A*N - alias = {live.a_tok:,.0f}*{n:,} - {alias:,}",
                              live.a_tok * n - alias))
        else:
            terms.append(Term(f"recomputed layer ({layer_activations.kind_label(sh, j)})", "activations",
                              f"A_{j}*N - alias = {live.per_layer[j]:,.0f} - {alias:,}", live.per_layer[j] - alias))
    terms += workspace
    above = sh.layers - 1 - j
    if above:
        terms.append(Term(f"gradients ({above} layers)", "grads", f"{above}*P_l_t*4/S", above * grad_layer))
    if live.head_grad is not None:
        terms.append(live.head_grad)
    if s.uses_fsdp:
        f = _gathered(s)
        terms += [*live.fsdp_root, Term("FSDP layer buffers (2 gathered, grad, fp32 reduce copy)", "fsdp_buffers",
                                        f"P_l*(3f + 4) = {p_l:,}*(3*{f} + 4)", p_l * (3 * f + 4))]
    return terms


def _kinds_priced(shape) -> bool:
    """Whether some layer is priced by longdoc.plan.layer_activations rather than as a Llama-style layer (A*N)."""
    return bool(shape.experts is not None or shape.mla is not None or shape.indexer is not None or shape.attn_gate
                or any(shape.mixer(j) in MODELLED_MIXERS for j in range(shape.layers)))


def layer_saved_bytes(s: Setup) -> list[float]:
    """Bytes each decoder layer saves for its backward on this rank's N tokens (A*N for a Llama-style layer;
    other kinds: longdoc.plan.layer_activations)."""
    sh, c = s.shape, s.c
    args = (c, s.lora, s.lora_rank, s.lora_targets, s.dev.autocast, s.tiled_mlp)
    parts = layer_parts_per_token(sh, *args)
    if not _kinds_priced(sh):
        return [sum(parts.values()) * s.tokens] * sh.layers
    dense = layer_parts_per_token(layer_activations.dense_shape(sh), *args)
    pc = layer_activations.Pieces.of(s.layout, s.cp, s.padded_len, s.micro_batch)
    return [layer_activations.layer_bytes(sh, j, s.tokens, pc, c, s.padded_len, parts, dense, s.tiled_mlp,
                                          s.dev.autocast) for j in range(sh.layers)]


def _kinds_formula(shape, per_layer: list[float]) -> str:
    """'sum of A_j*N': the layers grouped by kind, bytes each."""
    groups: dict[tuple[str, float], int] = {}
    for j, b in enumerate(per_layer):
        key = (layer_activations.kind_label(shape, j), round(b))
        groups[key] = groups.get(key, 0) + 1
    return "sum A_j*N = " + " + ".join(f"{k}*{b:,} ({label})" for (label, b), k in groups.items())


def _loss_inputs(s: Setup) -> Term:
    """The final norm (fp32 input, rsqrt, normed), the lm_head's input and the chunked loss's copy of its tokens'
    hidden states."""
    n, h = s.tokens, s.shape.hidden
    r, rs = _residual(s)
    if s.shape.norm_fp32 and r < 4:  # the final norm keeps its fp32 normalised x (shapes.ModelShape.norm_fp32)
        return Term("final norm + loss inputs", "activations", f"N*(8h + 4 + 2{rs}h) = {n:,}*(8*{h} + 4 + 2*{r}*{h})",
                    n * (8 * h + 4 + 2 * r * h))
    return Term("final norm + loss inputs", "activations", f"N*(4h + 4 + 3{rs}h) = {n:,}*(4*{h} + 4 + 3*{r}*{h})",
                n * (4 * h + 4 + 3 * r * h))


def saved_for_backward(s: Setup) -> list[Term]:
    """The tensors a step has saved for its backward when its forward (loss included) ends: every layer's (or its
    checkpoint), RoPE's cos/sin, the final norm and the loss's inputs. Without checkpointing this is what
    `longdoc bench kinds` counts as saved bytes (tests/unit/test_plan_kinds.py); unchunked, the loss keeps its
    fp32 log-probs N*V*4 in place of the chunked loss's copy of the hidden states."""
    est = estimate(s)
    terms = [t for t in est.phases["loss"] if t.label.startswith(("saved activations", "checkpoints", "rotary"))]
    n, h, v = s.tokens, s.shape.hidden, s.shape.vocab
    ids = Term("token ids and labels (int64)", "activations", f"16*N = 16*{n:,}", 16 * n)
    if s.loss_chunk is not None:
        return [*terms, _loss_inputs(s), ids]
    r, rs = _residual(s)
    normed = 4 if s.shape.norm_fp32 else r
    return [*terms, Term("final norm + lm_head input + fp32 log-probs", "activations",
                         f"N*(4h + 4 + {normed}h + {rs}h + 4V) = {n:,}*(4*{h} + 4 + {normed}*{h} + {r}*{h} + 4*{v:,})",
                         n * (4 * h + 4 + normed * h + r * h + 4 * v)), ids]


def _autocast_weights(s: Setup) -> dict[str, list[Term]]:
    """bf16 weight copies autocast holds at the end of the forward and in the loss backward (none outside CPU
    autocast).

    Casts of trained weights are cached until the forward (the loss's forward included) leaves autocast, before
    any backward (135M at 4k tokens: +6% predicted with the cache in the loss phase, +0.3% without); frozen
    weights are cast per op, and the copies a linear saves for its backward live as long as its activations.
    """
    if not s.dev.autocast:
        return {"forward": [], "loss": []}
    sh, c = s.shape, s.c
    head = sh.params.head or sh.params.embed
    # the loss backward holds the lm_head's bf16 copy (its chunk's recompute casts it again; 135M LoRA at 8k:
    # the bf16 run peaks 0.046 GiB above the fp32 one, this term is 0.053)
    head_copy = Term("autocast bf16 lm_head copy", "activations", f"P_head*c = {head:,}*{c}", head * c)
    if not s.lora:  # the loss phase is the loss's backward: autocast's forward cache has been left by then
        t = Term("autocast bf16 weight cache", "activations", f"P_mm*c = {sh.params.matmul:,}*{c}",
                 sh.params.matmul * c)
        return {"forward": [t], "loss": [head_copy]}
    if s.checkpointing:
        return {"forward": [], "loss": [head_copy]}
    t = Term(f"autocast bf16 weights saved ({sh.layers} layers)", "activations",
             f"n*P_l*c = {sh.layers}*{sh.params.layer:,}*{c}", sh.layers * sh.params.layer * c)
    return {"forward": [t], "loss": [t, head_copy]}


def _adam_temporaries(s: Setup) -> Term:
    if s.dev.is_gpu:  # foreach AdamW: one sqrt(exp_avg_sq) copy of every tensor of the shard
        return Term("AdamW foreach temporaries", "optimizer", f"P_t*4/S = {s.trainable:,}*4/{s.shards}",
                    s.trainable * 4 / s.shards)
    sh = s.shape
    largest = max(sh.params.embed, sh.params.head, sh.hidden * sh.intermediate) if not s.lora else s.trainable
    # per-tensor AdamW on CPU: sqrt(exp_avg_sq) and the denominator, for the largest tensor
    return Term("AdamW temporaries", "optimizer", f"2*largest*4 = 2*{largest:,}*4", 2 * largest * 4)
