"""Tensor and expert parallelism on torch.distributed: one model split across ranks.

group.py: the ranks and the collectives the model uses; plan.py: what each rank holds (pure);
shard.py: a model cut to one rank's share; launch.py: the ranks of one command started on this
host; lockstep.py: one scheduler's decisions replayed on every rank. The engine's side of a cut
model (its sampler over a vocabulary shard) is engine/sharded/.
"""
