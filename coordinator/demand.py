"""What one request asks of a worker's KV cache, as an upper bound, before any worker has tokenized it.

Owns: the reservation estimate. The coordinator has no tokenizer, so before a worker answers it
reserves `min(session_max_tokens, prompt_bytes + TEMPLATE_TOKENS + max_tokens)` tokens: every token
covers at least one byte of UTF-8, the chat template adds at most `TEMPLATE_TOKENS`, and no session
can hold more than `session_max_tokens`. Once the worker answers with `X-Prompt-Tokens`, the
reservation shrinks to the exact `min(session_max_tokens, prompt_tokens + max_tokens)`.
Must not: hold state or do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# Chat-template tokens added around a prompt (role markers, newlines); SmolLM2's template adds ~10.
TEMPLATE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Demand:
    prompt_bytes: int
    max_tokens: int
    new_session: bool = True  # False when it continues a session that already holds its sequence slot

    def tokens(self, session_max_tokens: int) -> int:
        """Upper bound of the KV tokens this request can make a worker hold."""
        return min(session_max_tokens, self.prompt_bytes + TEMPLATE_TOKENS + self.max_tokens)

    def exact_tokens(self, prompt_tokens: int, session_max_tokens: int) -> int:
        return min(session_max_tokens, prompt_tokens + self.max_tokens)
