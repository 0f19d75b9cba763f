"""Integration tests: the real coordinator and real workers on loopback."""
