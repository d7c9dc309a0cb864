"""Device-specific kernels behind the model's matmuls (the maths stays in model.py)."""
