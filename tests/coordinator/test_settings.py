from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.settings import Settings


def test_defaults() -> None:
    s = Settings.load({}, [])
    assert (s.host, s.port, s.heartbeat_interval, s.max_failover_attempts) == ("127.0.0.1", 1337, 10.0, 3)
    assert (s.stale_after, s.dead_after) == (30.0, 60.0)
    assert s.worker_token is None


def test_flag_beats_environment_beats_default() -> None:
    s = Settings.load({"PORT": "2000", "HEARTBEAT_INTERVAL": "0.5", "WORKER_TOKEN": "t"}, ["--port", "3000"])
    assert (s.port, s.heartbeat_interval, s.worker_token, s.stale_after) == (3000, 0.5, "t", 1.5)


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(ValidationError) as err:
        Settings.load({"PORT": "-1", "RELAY_BUFFER_EVENTS": "0"}, ["--log-level", "loud"])
    fields = {e["loc"][0] for e in err.value.errors()}
    assert fields == {"port", "relay_buffer_events", "log_level"}


def test_dead_must_not_come_before_stale() -> None:
    with pytest.raises(ValidationError):
        Settings.load({"STALE_AFTER_INTERVALS": "5", "DEAD_AFTER_INTERVALS": "4"})
