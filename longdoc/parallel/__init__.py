"""The context-parallel core: sequence layouts, ring / all-gather / Ulysses / USP attention, block kernels and their
merge, communication with timeouts, and state passing for recurrent layers. Torch only: it imports no other longdoc
layer (`longdoc.ContextParallel` and `longdoc.attention` come from `longdoc.parallel.api`)."""
