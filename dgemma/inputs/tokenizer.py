"""Tokenizer and chat template.

`tokenizer.json` is read with the `tokenizers` library; the chat template (from
`tokenizer_config.json` or `chat_template.jinja`) is rendered with jinja2 in a sandbox, with the
same conventions as `transformers` (trim_blocks, lstrip_blocks, `raise_exception`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..config import ConfigError

# Gemma 4's turn format: <bos><|turn>user\n...<turn|>\n<|turn>model\n
_TURNS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n@CONTENT@<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
DEFAULT_CHAT_TEMPLATE = _TURNS_TEMPLATE.replace("@CONTENT@", "{{ message['content'] | trim }}")
# The same turns with content as a list of parts too, rendered as Gemma 4's template renders them:
# text parts trimmed, an image part as <|image|>, a video part as <|video|>, nothing between them.
GEMMA4_CHAT_TEMPLATE = _TURNS_TEMPLATE.replace(
    "@CONTENT@",
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% elif item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'video' %}<|video|>"
    "{% endif %}{% endfor %}{% endif %}",
)
# A media part's placeholder: the template variable that names it (the processor passes them), else Gemma 4's.
PLACEHOLDERS = {"image": ("image_token", "<|image|>"), "video": ("video_token", "<|video|>")}


class ChatTemplateError(ValueError):
    """Messages that the chat template cannot render."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _check_content(i: int, content: Any) -> None:
    """A message's content: a string, or a list of parts each with a string 'type' (text parts
    with a string 'text'), as OpenAI and transformers write multimodal messages."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ChatTemplateError(f"message {i}: 'content' must be a string or a list of parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ChatTemplateError(f"message {i}: content part {j} must be an object with a string 'type'")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ChatTemplateError(f"message {i}: content part {j} is a text part without a string 'text'")


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict | None = None, chat_template: str | None = None):
        self._tok = tokenizer
        self.config = config or {}
        self.chat_template = chat_template
        self.bos_token = self._special("bos_token", "<bos>")
        self.eos_token = self._special("eos_token", "<eos>")
        self.pad_token = self._special("pad_token", "<pad>")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def _special(self, key: str, default: str) -> str | None:
        value = self.config.get(key, default)
        if isinstance(value, dict):  # AddedToken serialised as a dict
            value = value.get("content")
        if value is not None and self._tok.token_to_id(value) is None:
            return None
        return value

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise ConfigError(f"{tok_file} not found")
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ConfigError(f"{tok_file} is not a valid tokenizer: {e}") from None
        config: dict = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                config = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg_file} is not valid JSON: {e}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        return cls(tok, config, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """tokenizer.json's content (what llguidance reads)."""
        return self._tok.to_str()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the vocabulary's longest token: no token covers more characters of text
        (the server's cap on prompt characters before tokenizing)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def _encoding(self, text: str, add_special_tokens: bool):
        """tokenizers' Encoding of `text`. Through encode_batch, which releases the GIL while it
        works (encode holds it: seconds for a long text, with every other thread stopped)."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, a leading <bos> if the tokenizer does not add one."""
        ids = self._encoding(text, add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (no special tokens) and each token's [start, end) character span."""
        enc = self._encoding(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @staticmethod
    def flatten_content(content: str | list[dict[str, Any]], **tokens: Any) -> str:
        """Content parts as the text Gemma 4's template writes for them: text parts trimmed, media
        parts as their placeholder (`image_token` / `video_token` if given, else Gemma 4's)."""
        if isinstance(content, str):
            return content
        out = []
        for part in content:
            if part["type"] == "text":
                out.append(part["text"].strip())
            elif part["type"] in PLACEHOLDERS:
                key, default = PLACEHOLDERS[part["type"]]
                out.append(tokens.get(key) or default)
        return "".join(out)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template applied to OpenAI-style messages ({"role", "content"}); content is a
        string or a list of parts ({"type": "text", "text": ...}, {"type": "image", ...}, ...)."""
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"message {i} must be an object with a string 'role'")
            _check_content(i, m.get("content"))
        template = self.chat_template or DEFAULT_CHAT_TEMPLATE
        if template == DEFAULT_CHAT_TEMPLATE:  # it only takes strings: parts become text with placeholders
            messages = [dict(m, content=self.flatten_content(m["content"], **kwargs)) for m in messages]
        try:
            return self._env.from_string(template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = True, **kwargs: Any
    ) -> list[int] | str:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        return self._encoding(text, add_special_tokens=False).ids
