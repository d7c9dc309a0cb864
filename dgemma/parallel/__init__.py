"""Tensor and expert parallelism on torch.distributed: one model split across ranks.

group.py: the ranks and the collectives the model uses; plan.py: what each rank holds (pure);
shard.py: a model cut to one rank's share; sampling.py: the sampler's statistics over a
vocabulary split across ranks, without gathering the logits.
"""
