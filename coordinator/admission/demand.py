"""What one request asks of a worker's KV cache, as an upper bound, before any worker has tokenized it.

Owns: the reservation estimate. The coordinator has no tokenizer, so before a worker answers it
reserves `min(session_max_tokens, prompt_bytes + TEMPLATE_TOKENS + max_tokens)` tokens: every token
covers at least one byte of UTF-8, the chat template adds at most `TEMPLATE_TOKENS`, and no session
can hold more than `session_max_tokens`. Once the worker's `admitted` event gives the prompt's length, the
reservation shrinks to the exact `min(session_max_tokens, prompt_tokens + max_tokens)`. A request of
`choices` > 1 takes that many sequences and that many times the tokens, as the worker reserves them:
each choice's sequence holds its own copy of the prompt (a split KV cache copies the cells).
Must not: hold state or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# Chat-template tokens added around a prompt (role markers, newlines); SmolLM2's template adds ~10.
TEMPLATE_TOKENS = 64
# And around each further chat message (role markers, end-of-turn): SmolLM2's adds 5.
MESSAGE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Demand:
    prompt_bytes: int
    max_tokens: int
    new_session: bool = True  # False when it continues a session that already holds its sequence slot
    messages: int = 0  # chat messages the worker renders with its template (0: a single prompt)
    choices: int = 1  # sequences generated from the prompt (OpenAI's `n`; only ever one-shot)
    # An interactive request: a worker whose every sequence is taken may park a batch request for it
    # (WorkerLoad.parkable), so it needs no free sequence or KV where one can be parked.
    preempts: bool = False

    @property
    def sessions(self) -> int:
        """Sequence slots it takes on a worker: none when it continues a session that holds its own."""
        return self.choices if self.new_session else 0

    def tokens(self, session_max_tokens: int) -> int:
        """Upper bound of the KV tokens this request can make a worker hold."""
        template = TEMPLATE_TOKENS + MESSAGE_TOKENS * max(0, self.messages - 1)
        return self.choices * min(session_max_tokens, self.prompt_bytes + template + self.max_tokens)

    def exact_tokens(self, prompt_tokens: int, session_max_tokens: int) -> int:
        return self.choices * min(session_max_tokens, prompt_tokens + self.max_tokens)
