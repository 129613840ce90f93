"""The benchmarks (`longdoc bench`): attention, training throughput, memory, calibration of the planner.

Modules:
    sections        the section names (no imports: the command line lists them cheaply)
    attention       CP efficiency E, zigzag gain Z, ring vs all-gather, on local gloo ranks
    gpu             CUDA only: longdoc's block kernels against one flash-attention call
    runs            real training steps of the trainer in fresh processes (TrainRun, run_steps)
    calibrate       the planner's memory estimate (`longdoc.plan.memory`) against those runs' peaks
    train_sections  the train, memory and longest sections built on `runs` and `calibrate`
    plots           PNG plots of the sections
    suite           every section in one run: bench.json, bench.md, plots; publish() copies them into docs/bench
    cli             the `longdoc bench` verb
The benchmarks import the planner to put its prediction beside each measurement; the planner never
imports the benchmarks.
"""
