"""How a request's text becomes the engine's tokens, and where a stored document sits in them.

The tokenizer adapters live here too: :class:`HFTokenizer` (a model directory's tokenizer) and
:class:`ByteTokenizer` (the random-init specs' offline one), both behind :class:`Tokenizer`.

Reuse rests on one equality: the tokens the origin stored a document's chunks for are exactly
the first tokens of every request that carries the document. Engines tokenize two ways:

- a **completion** prompt (vLLM ``/v1/completions``, ``tokenizer(text)``): the text with the
  tokenizer's own special tokens (a BOS for Llama 2/3, Mistral; none for SmolLM2);
- a **chat** request (vLLM ``/v1/chat/completions``, ``apply_chat_template``): the chat template
  rendered to text, then tokenized *without* adding special tokens (the template writes its own).

A document is stored for one :data:`Layout`, which says where it sits in the requests that reuse it:

- ``text``: the document starts a completion prompt; a request is ``document + question``;
- ``system``: the document is the system message; a request is ``[system: document, user: question]``;
- ``user``: the document starts the first user message; a request is ``[user: document + question]``.

:func:`document_tokens` gives the tokens every such request starts with — the rendered prompt up to
the end of the document's text — and :func:`request_tokens` a whole request. So the layout for
reuse is always *document first, question after*: anything that varies per request (a date, a
user name, the question) placed before the document changes every chunk after it.

Invariant: for a tokenizer whose pre-tokenizer splits at special tokens (every BPE tokenizer with
added special tokens), ``document_tokens(t, d, layout)`` is a prefix of ``request_tokens(t, d, q,
layout)`` except possibly for the last token before the cut when the question's first characters
merge with the document's last ones (``text`` and ``user``; a ``system`` document ends at the
template's end-of-message token, so it is exact). Chunks are whole, so at most the last full chunk
of a document can be affected, and only when the document ends exactly on a chunk boundary.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, Sequence, get_args

from kdn.errors import InvalidInput

__all__ = ["Layout", "LAYOUTS", "Message", "Tokenizer", "ByteTokenizer", "HFTokenizer", "check_layout",
           "document_tokens", "request_tokens", "chat_tokens", "render_chat", "check_chat_template"]

Layout = Literal["text", "system", "user"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
Message = dict[str, str]  # {"role": ..., "content": ...}

# a marker no document contains, where the rendered chat is cut: the document's end
_CUT = "\x00kdn-document-end\x00"


class Tokenizer(Protocol):
    """What KDN needs of a tokenizer.

    ``encode`` tokenizes a fragment (no special tokens added); ``encode_prompt`` a whole
    completion prompt exactly as the engine does (with the tokenizer's BOS, if it adds one);
    ``render_chat`` renders messages with the model's chat template; ``bos_token_id`` is None
    when the tokenizer has no BOS."""

    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 3..258; 0 = pad, 1 = bos, 2 = eos. Works offline, never fails.
    Adds no special token to a prompt and has no chat template."""

    vocab_size = 259
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    _OFFSET = 3

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        raise InvalidInput("this model has no chat template (a random-init built-in spec): use the text layout")

    def decode(self, ids: Sequence[int]) -> str:
        raw = bytes(i - self._OFFSET for i in ids if self._OFFSET <= i < 256 + self._OFFSET)
        return raw.decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter for a ``transformers`` tokenizer loaded from a local directory."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.bos_token_id: int | None = getattr(tok, "bos_token_id", None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
        if not getattr(self._tok, "chat_template", None):
            raise InvalidInput("this model's tokenizer has no chat template: use the text layout")
        try:
            return str(self._tok.apply_chat_template(list(messages), tokenize=False,
                                                     add_generation_prompt=add_generation_prompt))
        except Exception as exc:  # jinja2 errors: a template that refuses these messages
            raise InvalidInput(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from exc

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def check_layout(layout: str) -> Layout:
    if layout not in LAYOUTS:
        raise InvalidInput(f"unknown prompt layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout  # type: ignore[return-value]


def render_chat(tok: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidInput(f"a chat message is {{'role': str, 'content': str}}, got {m!r:.80}")
    return tok.render_chat(list(messages), add_generation_prompt=add_generation_prompt)


def chat_tokens(tok: Tokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """A chat request's tokens as an OpenAI-style chat endpoint computes them."""
    return list(tok.encode(render_chat(tok, messages, add_generation_prompt=add_generation_prompt)))


def _prefix_text(tok: Tokenizer, text: str, layout: Layout) -> str:
    """The rendered chat up to the end of ``text`` placed as ``layout``'s message."""
    if _CUT in text:
        raise InvalidInput("the document contains KDN's internal cut marker")
    rendered = render_chat(tok, [{"role": layout, "content": text + _CUT}], add_generation_prompt=False)
    at = rendered.find(_CUT)
    if at < 0:
        raise InvalidInput(f"the model's chat template drops a {layout} message: a document cannot be stored as one")
    return rendered[:at]


def document_tokens(tok: Tokenizer, text: str, layout: str = "text") -> list[int]:
    """The tokens every request carrying ``text`` as ``layout`` starts with."""
    layout = check_layout(layout)
    if layout == "text":
        return list(tok.encode_prompt(text))
    return list(tok.encode(_prefix_text(tok, text, layout)))


def request_tokens(tok: Tokenizer, document: str, question: str, layout: str = "text") -> list[int]:
    """A whole request: ``document`` placed as ``layout``, then ``question`` (and, for the chat
    layouts, the assistant turn's opening, so the model answers)."""
    layout = check_layout(layout)
    if layout == "text":
        return list(tok.encode_prompt(document + question))
    if layout == "system":
        return chat_tokens(tok, [{"role": "system", "content": document}, {"role": "user", "content": question}])
    return chat_tokens(tok, [{"role": "user", "content": document + question}])


def check_chat_template(tok: Tokenizer, what: str) -> None:
    """Refuse a tokenizer whose chat template cannot carry a system message."""
    try:
        _prefix_text(tok, "probe", "system")
    except InvalidInput as exc:
        raise InvalidInput(f"{what}: {exc}") from exc
