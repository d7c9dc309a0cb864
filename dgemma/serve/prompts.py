"""A request's prompt as the engine takes it: a completion's text or token ids, a chat rendered.

A chat goes through the checkpoint's chat template (the tokenizer's; with images or video, the
processor's, after media/ has fetched and checked them), with tools declared and tool
calls rendered in Gemma 4's format (tools/) and thinking switched on where asked (reasoning.py).
Text that cannot fit the context is refused before any of it is rendered or tokenized.
"""

from __future__ import annotations

import json
from typing import Any

from ..inputs.model_inputs import MediaError, ModelInputs
from ..inputs.tokenizer import ChatTemplateError
from .errors import ApiError, excerpt, media_error
from .media import sources as media
from .media.policy import MediaPolicy, MediaRef
from .openai.protocol import ChatMessage, ChatParams, RequestParams
from .reasoning import THINK, template_thinks, think_in_system_turn
from .tools.render import render_chat
from .tools.specs import ToolError, ToolSpec, check_messages

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def has_media(messages: list[ChatMessage]) -> bool:
    """Whether any message holds a content part that is not text (media, or a part to refuse)."""
    return any(
        isinstance(m.content, list)
        and any(not isinstance(p, dict) or p.get("type") not in media.TEXT_PARTS for p in m.content)
        for m in messages
    )


def _text_chars(message: ChatMessage) -> int:
    """Characters of text a message adds to the prompt: its text content, and the strings and
    keys of its tool calls (walked without recursion: they are not checked yet)."""
    content = message.content
    if isinstance(content, str):
        chars = len(content)
    elif isinstance(content, list):
        chars = sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    else:
        chars = 0
    stack = [message.tool_calls]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, dict):
            chars += sum(len(k) for k in value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return chars


def _processor_content(content: list, loaded) -> str | list[dict]:
    """A message's content for the processor: text pieces and the next loaded media parts in
    order; a message without media stays a string."""
    if all(isinstance(p, str) for p in content):
        return "".join(content)
    return [{"type": "text", "text": p} if isinstance(p, str) else next(loaded) for p in content]


def _chat_role(i: int, m: ChatMessage) -> str:
    """The role the chat template sees (developer is rendered as system)."""
    if m.role not in CHAT_ROLES:
        raise ApiError(
            400,
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (got {excerpt(m.role)})",
            f"messages[{i}].role",
            "invalid_value",
        )
    return "system" if m.role == "developer" else m.role


class PromptBuilder:
    """Prompts checked, rendered and tokenized for one served model; every failure a 400 naming
    the field. Its tokenizing and rendering methods block (media is fetched and decoded in
    `chat_inputs`): the routes run them off the event loop."""

    def __init__(self, model, max_context: int, media_policy: MediaPolicy):
        self.model, self.tokenizer, self.media = model, model.tokenizer, media_policy
        self.context = max_context
        # no prompt that fits the context holds more characters than this: checked before rendering
        self.max_prompt_chars = max_context * model.tokenizer.max_token_chars

    def check_size(self, params: RequestParams, spec: ToolSpec | None) -> None:
        """Refuse text that cannot fit the context before any of it is rendered or tokenized: no
        token covers more than the vocabulary's longest token of characters."""
        if isinstance(params, ChatParams):
            chars, param = sum(_text_chars(m) for m in params.messages), "messages"
            chars += len(json.dumps(spec.tools)) if spec is not None and spec.tools else 0
        else:
            prompt = params.prompt[0] if isinstance(params.prompt, list) and len(params.prompt) == 1 else params.prompt
            chars, param = (len(prompt) if isinstance(prompt, str) else 0) + len(params.suffix or ""), "prompt"
        if chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"{param} holds {chars} characters of text; a prompt that fits this server's context of "
                f"{self.context} tokens holds at most {self.max_prompt_chars} ({self.context} x the longest "
                f"token, {self.tokenizer.max_token_chars} characters)",
                param,
                "context_length_exceeded",
            )

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # lone surrogates and other text the tokenizer rejects
            raise ApiError(400, f"prompt could not be tokenized: {e}", "prompt", "invalid_value") from None

    def completion_ids(self, prompt: Any) -> list[int]:
        """A completion's prompt as token ids: a string, a token-id list, or a one-element list of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(
                    400, f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})", "prompt", "invalid_value"
                )
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(
                400, f"prompt: one prompt per request is supported (got {len(prompt)})", "prompt", "invalid_value"
            )
        raise ApiError(
            400,
            f"prompt must be a non-empty string or a non-empty list of token ids (got {excerpt(prompt)})",
            "prompt",
            "invalid_value",
        )

    def chat_inputs(
        self,
        messages: list[ChatMessage],
        soft_tokens: dict | None = None,
        spec: ToolSpec | None = None,
        template_kwargs: dict | None = None,
    ) -> ModelInputs:
        """The chat rendered and tokenized; with media parts, through the checkpoint's processor
        with `soft_tokens` (its max_soft_tokens, video_max_soft_tokens); with `spec`'s tools
        declared and tool calls / results rendered in Gemma 4's format (tools.render_chat), then
        the text the answer must start with (tool_choice) after the generation prompt;
        `template_kwargs` passed to the template (enable_thinking: <|think|> written into the
        system turn when the template does not). Blocking: media is fetched and decoded here, so
        callers run it off the event loop."""
        soft_tokens = soft_tokens or {}
        try:
            turns = [(_chat_role(i, m), media.parse_content(i, m.content)) for i, m in enumerate(messages)]
            try:
                extras = check_messages(
                    [
                        {"role": r, "content": m.content, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}
                        for (r, _), m in zip(turns, messages)
                    ]
                )
            except ToolError as e:
                raise ApiError(400, str(e), e.param, "invalid_value") from None
            refs = [p for _, content in turns for p in content if isinstance(p, MediaRef)]
            if refs:
                self._check_media(refs)
            processor = self.model.processor if refs else None
            loaded = iter([media.processor_part(ref, self.media, processor) for ref in refs])
            rendered = [{"role": r, "content": _processor_content(c, loaded)} for r, c in turns]
            chat = render_chat(rendered, extras, spec, self.tokenizer.chat_template)
            turns, kwargs = chat.messages, {**(template_kwargs or {}), **chat.kwargs}
            if kwargs.get("enable_thinking") and not template_thinks(self.tokenizer.chat_template):
                turns = self._think(turns)
            if processor is None:
                inputs = ModelInputs(self._render(self.tokenizer, turns, **kwargs))
            else:
                inputs = self._render(processor, turns, **kwargs, **soft_tokens)
            if chat.suffix:  # text only (calls, results, a call's opening): after the generation prompt
                inputs.input_ids = inputs.input_ids + self.encode_text(chat.suffix)
            return inputs
        except MediaError as e:
            raise media_error(e) from None

    def _think(self, turns: list[dict]) -> list[dict]:
        """Thinking switched on by dgemma for a template that does not read enable_thinking."""
        if self.tokenizer.token_to_id(THINK) is None:
            raise ApiError(
                400,
                "reasoning_effort / chat_template_kwargs.enable_thinking: this checkpoint cannot think "
                f"(its chat template does not read enable_thinking and its tokenizer has no {THINK} token)",
                "reasoning_effort",
                "unsupported_parameter",
            )
        return think_in_system_turn(turns)

    def thinks(self, prompt: ModelInputs) -> bool:
        """Whether the prompt switches thinking on (<|think|>: the template wrote it, or a client did)."""
        think = self.tokenizer.token_to_id(THINK)
        return think is not None and think in prompt.input_ids

    def encode_text(self, text: str) -> list[int]:
        """Text to put after a rendered prompt (or an insertion's suffix) as token ids, no special tokens added."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # lone surrogates
            raise ApiError(400, f"messages could not be tokenized: {e}", "messages", "invalid_value") from None

    def _check_media(self, refs: list[MediaRef]) -> None:
        """Refuse media the checkpoint or the limits cannot take, before fetching any of it."""
        if not self.model.supports_images:
            raise ApiError(
                400,
                f"{refs[0].param}: this model has no vision tower (or no processor config), so only "
                f"text parts are accepted (got {refs[0].kind} parts)",
                refs[0].param,
                "invalid_media",
            )
        if len(refs) > self.media.max_items:
            raise ApiError(
                400,
                f"messages: {len(refs)} images and videos in one request; this server takes at most "
                f"{self.media.max_items} (--max-images-per-request)",
                "messages",
                "invalid_media",
            )

    @staticmethod
    def _render(template_owner, rendered: list[dict], **kwargs):
        """`apply_chat_template` of the tokenizer (text: ids) or the processor (media: ModelInputs),
        its failures as 400s; MediaError passes through, to be tied to its part."""
        try:
            return template_owner.apply_chat_template(rendered, add_generation_prompt=True, **kwargs)
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", "messages", "invalid_value") from None
        except MediaError:
            raise
        except Exception as e:  # text the tokenizer rejects (lone surrogates)
            raise ApiError(400, f"messages could not be tokenized: {e}", "messages", "invalid_value") from None
