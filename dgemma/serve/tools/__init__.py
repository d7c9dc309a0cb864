"""Tool calling: OpenAI's tool fields checked (specs.py), Gemma 4's call syntax (syntax.py), a chat
with tools rendered for the template (render.py), the model's calls read back out of its answer
(calls.py), and forced calls as a grammar (grammar.py)."""
