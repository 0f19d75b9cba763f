"""The model's own chat template: the Jinja program in its GGUF (`tokenizer.chat_template`), run as
Hugging Face's `apply_chat_template` and llama.cpp's server with `--jinja` run it.

Owns: compiling the template once (a sandboxed Jinja environment with the globals and filters chat
templates use: `raise_exception`, `strftime_now`, `tojson`, `{% generation %}`), rendering a
conversation with the assistant's turn opened, and turning the template's own refusals
(`raise_exception("Conversation roles must alternate ...")`) into `TemplateRefusal`.
Must not: tokenize or know llama.cpp; llama_model.py hands it the template's text and the special
tokens' text, and falls back to llama.cpp's built-in matcher only when the model has no template or
this one does not compile.

Why: llama.cpp's built-in matcher recognises a template by its markers and writes the turns its own
way, so what a template adds of its own is lost. SmolLM2's default system prompt, for one: a chat of
one user message, "Hello", was 10 prompt tokens with the matcher and is 31 with the template
(`tests/worker/backends/test_chat_template.py`, which also checks the rendering against
llama-cpp-python's own Jinja formatter).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRefusal(ValueError):
    """The template refused the conversation (its `raise_exception`), or failed while rendering it."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (Hugging Face marks the assistant's tokens with it):
    rendered as its content."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str) -> None:
    raise TemplateRefusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """`ChatTemplate(source, bos="<s>", eos="</s>")`; `render(messages)` -> the prompt's text."""

    def __init__(self, source: str, *, bos: str, eos: str, strip_bos: bool) -> None:
        """`strip_bos`: the tokenizer adds the BOS token itself, so a leading one the template writes
        is taken off (else the prompt would start with two)."""
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_Generation, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f))
        self._program = environment.from_string(source)  # jinja2.TemplateError when it does not compile
        self._bos, self._eos, self._strip_bos = bos, eos, strip_bos

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        try:
            text = self._program.render(messages=list(messages), tools=list(tools) if tools else None,
                                        add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos)
        except TemplateRefusal:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TemplateRefusal(f"the model's chat template cannot render this conversation: {exc}") from None
        if self._strip_bos and self._bos and text.startswith(self._bos):
            text = text[len(self._bos):]
        return text
