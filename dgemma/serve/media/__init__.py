"""Media in the server: content parts turned into the processor's parts, fetched within the
operator's policy (sources.py)."""
