"""Structured output: response_format and the guided_* fields compiled to a grammar (formats.py),
and how big and deep any grammar of a request may be, tools' included (limits.py)."""
