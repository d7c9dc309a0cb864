"""ollama's API (/api/*) beside the OpenAI one: its routes (routes.py), its bodies translated into
OpenAI's (protocol.py), and its answers, whole or as newline-delimited JSON (responses.py)."""
