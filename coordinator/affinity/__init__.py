"""Affinity: where a request would rather go, and must go. Sessions (a `session_id` is served where its
KV lives), conversations (an OpenAI-style client's next turn prefers the worker of the previous one)
and prefixes (the workers a prompt's leading blocks were sent to). Every table is keyed by tenant."""
