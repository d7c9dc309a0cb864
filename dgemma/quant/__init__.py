"""Quantised weights: formats (pure maths), modules that compute with them, checkpoints."""
