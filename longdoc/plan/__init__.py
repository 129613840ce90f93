"""The planner (`longdoc plan`): will a long-context fine-tuning run fit, how fast, with which cp/dp/strategy.

    from longdoc.plan.planner import PlanRequest, plan
    result = plan(PlanRequest(model="Llama-3.1-8B", seq_len=131072, gpus=8, gpu="h100"))
    result.best.describe(), result.best.memory.total_gib, result.best.time.tokens_per_s

Modules, each depending only on those listed before it:
    hardware           devices, links and the efficiency assumptions (peak figures, not measurements)
    layer_shapes       each layer's mixer and MLP, the MoE / Mamba2 / Gated DeltaNet / MLA / DSA shapes, from a config
    shapes             a model's shape and exact parameter counts from its config alone (meta device, no weights)
    autocast           what a decoder layer saves under CPU bf16 autocast (fp32 weights)
    activations        what a Llama-style decoder layer saves per token (A), in parts
    layer_activations  what a layer of another kind saves: recurrent mixers under state passing, MoE, MLA, DSA
    memory             per-rank peak memory of one training step, term by term, phase by phase
    prefill            per-rank peak memory of a CP prefill without gradients (`longdoc ask`), term by term
    timing             step time: FLOPs, bandwidth, what overlaps what
    planner            every open (cp, dp, strategy, checkpointing), the recommendation, what to change if none fits
    report             the text rendering of a plan
    cli                the `longdoc plan` verb
Works from formulas only and never imports the benchmarks; `longdoc.bench.calibrate` measures real runs
against `memory.estimate`.
"""
