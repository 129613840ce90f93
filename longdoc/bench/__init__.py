"""The benchmarks (`longdoc bench`): attention, training throughput, memory, calibration of the planner.

Modules:
    sections        the section names and the longest section's option names (no imports: --help lists them)
    attention       CP efficiency E, zigzag gain Z, ring vs all-gather, on local gloo ranks
    gpu             CUDA only: longdoc's block kernels against one flash-attention call
    runs            real training steps of the trainer in fresh processes (TrainRun, run_steps)
    calibrate       the planner's memory estimate (`longdoc.plan.memory`) against those runs' peaks
    train_sections  the train and memory sections built on `runs` and `calibrate`
    longest         the longest trainable sequence under a per-process cap, per model, cp and memory feature
    plots           PNG plots of the sections
    suite           every section in one run: bench.json, bench.md, plots; publish() copies them into docs/bench
    cli             the `longdoc bench` verb
The benchmarks import the planner to put its prediction beside each measurement; the planner never
imports the benchmarks.
"""
