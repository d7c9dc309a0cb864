"""Images and video in: decoding (decode.py), the Gemma 4 processor (processor.py) and the
inputs it hands the model (model_inputs.py)."""
