"""The SSE parser must give the same events however the bytes are split across reads."""

from __future__ import annotations

import pytest

from protocol.sse import SseEvent, SseParser, SseTooLarge, encode

STREAM = (
    ": ping\r\n\r\n"
    "event: token\r\ndata: {\"token\": \"h\u00e9llo \u4e16\u754c\", \"index\": 0}\r\n\r\n"
    "event: token\ndata: {\"token\": \"b\"}\n\n"
    "event: done\rdata: line1\rdata: line2\r\r"
    "data: no event name\r\n\r\n"
    "event: error\r\ndata:nospace\r\n\r\n"
).encode()

EXPECTED = [
    SseEvent("token", "{\"token\": \"h\u00e9llo \u4e16\u754c\", \"index\": 0}"),
    SseEvent("token", "{\"token\": \"b\"}"),
    SseEvent("done", "line1\nline2"),
    SseEvent("message", "no event name"),
    SseEvent("error", "nospace"),
]


def parse(chunks: list[bytes]) -> list[SseEvent]:
    parser = SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_whole_stream() -> None:
    assert parse([STREAM]) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_split_in_two_at_every_byte(cut: int) -> None:
    assert parse([STREAM[:cut], STREAM[cut:]]) == EXPECTED


def test_one_byte_at_a_time() -> None:
    assert parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_cr_then_lf_in_next_read_is_one_line_end() -> None:
    parser = SseParser()
    assert parser.feed(b"event: token\r") == []
    assert parser.feed(b"\ndata: 1\r") == []
    assert parser.feed(b"\n\r") == []
    assert parser.feed(b"\n") == [SseEvent("token", "1")]


def test_incomplete_event_is_held() -> None:
    parser = SseParser()
    assert parser.feed(b"event: token\r\ndata: 1\r\n") == []
    assert parser.feed(b"\r\n") == [SseEvent("token", "1")]


def test_unbounded_event_is_refused() -> None:
    parser = SseParser(max_event_chars=100)
    with pytest.raises(SseTooLarge):
        parser.feed(b"data: " + b"x" * 200)


@pytest.mark.parametrize("data", ["{\"a\": 1}", "two\nlines", "", "cr\rlf\r\nend", "sep\u2028kept"])
def test_encode_round_trips(data: str) -> None:
    expected = data.replace("\r\n", "\n").replace("\r", "\n")
    assert SseParser().feed(encode("token", data)) == [SseEvent("token", expected)]


def test_close_returns_an_event_whose_blank_line_never_came() -> None:
    parser = SseParser()
    assert parser.feed(b"event: done\r\ndata: {}\r\n\r\nevent: token\r\ndata: x") == [SseEvent("done", "{}")]
    assert parser.close() == SseEvent("token", "x")
    assert parser.close() is None


@pytest.mark.parametrize("cut", range(1, 40))
def test_crlf_only_reads_parse_as_any_line_ends_do(cut: int) -> None:
    """Reads whose line ends are all CRLF take the parser's one-split path; the same events, with a read
    that ends between CR and LF (the other path) or mid-line."""
    crlf = b"".join(encode(name, data) for name, data in (("token", '{"token":"a"}'), ("token", "x:y"),
                                                           ("done", "one\ntwo")))
    expected = [SseEvent("token", '{"token":"a"}'), SseEvent("token", "x:y"), SseEvent("done", "one\ntwo")]
    assert parse([crlf]) == expected
    assert parse([crlf[:cut], crlf[cut:]]) == expected
    assert parse([crlf.replace(b"\r\n", b"\n")]) == expected
