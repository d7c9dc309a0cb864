"""OpenAI's API: its routes (routes.py), what a request to /v1/completions and /v1/chat/completions
may hold (protocol.py; ollama's bodies are translated into these), its answers, whole or streamed
(responses.py), their log probabilities (logprobs.py), and insert mode and fixed canvas tokens
(insert.py)."""
