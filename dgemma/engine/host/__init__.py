"""The decoder step with its decisions on the host's side (eager torch ops, or the Triton kernels
launched one by one): the default step (step.py, which holds the one host decision rule) and the
turbo step (turbo.py). Every request on a CPU runs here; on a GPU, those the fused path
(engine/fused/) does not take."""
