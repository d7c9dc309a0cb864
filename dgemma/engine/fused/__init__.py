"""The engine's step on a GPU, whole on the device: its packed inputs (inputs.py), the decoder step
with sampling and decisions (step.py), the CUDA graphs that capture it per batch bucket
(graphs.py), and AR mode's captured token loop (ar.py)."""
