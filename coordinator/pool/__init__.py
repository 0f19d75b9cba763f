"""The pool: the workers as the coordinator knows them (`registry`, fed by heartbeats, with O(1) sums
per model) and their circuit breakers (`breaker`)."""
