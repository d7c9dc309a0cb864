"""Tools on offer and a stand-in engine for the tool-calling and client tests: a random model never
writes a call, so `FakeEngine` answers every request with fixed text, in blocks of 32 tokens, and
keeps the prompts it was given."""

from __future__ import annotations

import asyncio

from dgemma.engine.events import Block, Finished
from dgemma.serve.engine_thread import Job

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}
TOOLS = [WEATHER, TIME]


class FakeEngine:
    """Stands in for `EngineThread.submit`: answers with `text` (then EOS) in blocks of 32 tokens."""

    def __init__(self, tokenizer, eos: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.text, self.prompts, self.block = "", [], 32

    def __call__(self, prompt, config, seed, drafts=False, images=(), constraints=None, deadline=None, adapter=None):
        job = Job(list(prompt), config, seed, drafts, asyncio.get_running_loop(), list(images))
        self.prompts.append(self.tokenizer.decode(prompt, skip_special_tokens=False))
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.eos]
        blocks = [ids[i : i + self.block] for i in range(0, len(ids), self.block)]
        for k, block in enumerate(blocks):
            job.deliver(Block(0, k, block, k == len(blocks) - 1, 1))
        job.deliver(Finished(0, "eos", ids, len(blocks), len(ids) / len(blocks), len(prompt)))
        return job
