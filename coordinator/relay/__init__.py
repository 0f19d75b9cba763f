"""The relay: from a placed request to the client's last byte. `dispatch` opens the worker's stream
through the `upstream` client (failover before the first event); `stream` moves that stream into a
bounded `buffer`; `response` (streamed) and `collect` (one JSON answer) write it to the client under
the one `supervisor`, which decides how every request ended."""
