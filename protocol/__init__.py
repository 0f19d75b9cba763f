"""The wire contract shared by the coordinator and the workers (see inference.http.md)."""
