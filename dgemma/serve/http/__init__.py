"""The HTTP side of `dgemma serve`: binding and uvicorn's settings (listener.py), who may talk to it
(access.py), and a request's body read within limits, its client watched (connection.py)."""
