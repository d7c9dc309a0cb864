"""The engine on a model cut across ranks (parallel/shard.py cuts it): what the engine asks of such
a model (runtime.py: whether it is cut at all, the block counts every rank agrees on, the runner's
sampler calls) and the sampler's reductions over this rank's vocabulary shard (sampling.py)."""
