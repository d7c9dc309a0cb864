"""Media in the server: where it may come from (policy.py: `MediaPolicy`, the operator's flags),
content parts turned into the processor's parts, from data: and file:// URLs (sources.py), and
http(s) fetches guarded to public addresses (remote.py)."""
