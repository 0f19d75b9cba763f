"""`Message`: one turn of a conversation, model-neutral: what a session's history holds, what a request's
chat becomes, and what a backend's chat template renders.

Owns: the type. Must not: render or tokenize turns (worker/backends/chat_template.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.worker import CalledFunction


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[CalledFunction, ...] = ()  # an assistant's turn: the functions it called
    name: str | None = None  # a `tool` turn: the function whose result it is
