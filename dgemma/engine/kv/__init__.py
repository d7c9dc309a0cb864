"""The paged KV cache the scheduler and the runner share: the K/V tensors and the passes the model
attends through (paged_cache.py), block ids, reference counts and the prefix cache
(block_manager.py), and how many blocks each pool gets (budget.py)."""
