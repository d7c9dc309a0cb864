"""Servers for the tests, in-process (`ServerThread` on a free port of 127.0.0.1): the served names,
the app of the tiny random model that tests/conftest.py serves once per session, and the vision
servers that each test module configures with its own media policy."""

from __future__ import annotations

import openai

from dgemma.serve.app import create_app
from dgemma.serve.http.listener import ServerThread

MODEL = "tiny"  # the tiny random model's served name (conftest.py's `server`)
VISION_MODEL = "vision"
VISION_FAST = {"max_denoising_steps": 2, "ignore_eos": True, "max_soft_tokens": 70}


def openai_client(url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def tiny_random_app(model):
    """The app conftest.py's session server runs: room for 16 streams at once and 16 waiting."""
    return create_app(model, MODEL, max_active=16, max_queue=16)


def serve_vision(model, **app_kwargs) -> ServerThread:
    """A vision server (not started: use it as a context manager) with an openai `client`."""
    server = ServerThread(create_app(model, VISION_MODEL, max_active=4, max_queue=8, **app_kwargs))
    server.client = openai_client(server.url)
    return server
