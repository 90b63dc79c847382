"""OpenAI request bodies as the router reads them: validated, tokenized once as the engine does.

A completion's prompt (a string, token ids, or a batch of one of them) is tokenized with the
tokenizer's own special tokens (:meth:`kdn.prompts.Tokenizer.encode_prompt`); a chat request's
messages are rendered with the model's chat template and tokenized without them
(:func:`kdn.prompts.chat_tokens`), as vLLM's ``/v1/completions`` and ``/v1/chat/completions`` do.
A batch of several prompts is routed by its first. Anything the router cannot tokenize exactly as
the engine would (a chat with images, tools that change the template) is routed by load alone:
the tokens only steer routing, never the answer, since the host tokenizes the body itself.

The namespace rule is the engines' (:func:`kdn.keys.request_namespace`, which the
vLLM connector applies too): ``kv_transfer_params.kdn_tenant`` (and ``kdn_salt``), else
``cache_salt`` read as ``tenant`` or ``tenant:salt`` (a salt that is no valid tenant name becomes
a tenant named by its digest), else the router's default; ``kv_transfer_params: {"kdn": false}``
opts out of KDN; a parameter of the wrong type is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kdn.errors import InvalidInput
from kdn.keys import Namespace
from kdn.keys import request_namespace as namespace_of
from kdn.prompts import Tokenizer, chat_tokens

__all__ = ["Endpoint", "ParsedRequest", "parse_body", "request_namespace"]

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    tokens: list[int] | None  # None: the router cannot know the engine's tokens (routed by load)
    namespace: Namespace | None  # None: the request opted out of KDN
    stream: bool


def request_namespace(body: dict[str, Any], default: Namespace) -> Namespace | None:
    """The body's namespace by the engines' rule (:func:`kdn.keys.request_namespace`)."""
    return namespace_of(body.get("cache_salt"), body.get("kv_transfer_params"), default)


_MAX_ID = 1 << 32  # chunk keys hash token ids as uint32 (:func:`kdn.keys.tokens_u32`)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _MAX_ID for t in v)


def _text(s: str, what: str) -> str:
    """``s`` when a tokenizer can take it; ``InvalidInput`` when it holds a lone surrogate (JSON's
    ``\\ud800`` escapes decode to one), which is no text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)") from None
    return s


def _prompt_tokens(tok: Tokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return list(tok.encode_prompt(_text(prompt, "'prompt'")))
    if _is_ids(prompt) and prompt:
        return list(prompt)
    if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        if all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt):
            return _prompt_tokens(tok, prompt[0])
    raise InvalidInput("'prompt' must be a string, a list of token ids (integers in [0, 2**32)), or a list of either")


def _message_text(m: Any, i: int) -> str | None:
    """A message's text as the template sees it; None when it holds something other than text."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidInput(f"messages[{i}] must be an object with a string 'role'")
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise InvalidInput(f"messages[{i}].content parts must be objects with a 'type'")
            if part["type"] != "text":
                return None
            if not isinstance(part.get("text"), str):
                raise InvalidInput(f"messages[{i}].content text parts need a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidInput(f"messages[{i}].content must be a string or a list of parts")


def _chat_tokens(tok: Tokenizer, body: dict[str, Any]) -> list[int] | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list")
    plain = []
    for i, m in enumerate(messages):
        text = _message_text(m, i)
        if text is None:
            return None
        plain.append({"role": _text(m["role"], f"messages[{i}].role"),
                      "content": _text(text, f"messages[{i}].content")})
    if body.get("tools") or body.get("chat_template") or body.get("chat_template_kwargs"):
        return None  # the engine's template sees more than the router renders
    add = not body.get("continue_final_message", False) and body.get("add_generation_prompt", True) is not False
    try:
        return chat_tokens(tok, plain, add_generation_prompt=add)
    except InvalidInput:
        return None  # a template that refuses these messages: the engine will say why


def parse_body(raw: bytes, endpoint: Endpoint, tok: Tokenizer, default: Namespace) -> ParsedRequest:
    """Validate one request body and tokenize it. Raises ``InvalidInput`` naming what is wrong
    (and nothing else, whatever the bytes: nesting too deep to parse and numbers too long to
    convert are not JSON the router takes). ``null`` stands for an absent ``model`` or ``stream``,
    as in OpenAI's schema."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError, int digits
        raise InvalidInput(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"the body must be a JSON object, not {type(body).__name__}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidInput("'model' must be a string")
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise InvalidInput("'stream' must be true or false")
    if endpoint == "completions":
        if "prompt" not in body:
            raise InvalidInput("a completion request needs a 'prompt'")
        tokens: list[int] | None = _prompt_tokens(tok, body["prompt"])
    else:
        tokens = _chat_tokens(tok, body)
    return ParsedRequest(endpoint, body, tokens, request_namespace(body, default), stream)
