"""Reading a jobs file: both formats, defaults, keys, and every bad line reported with its number."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.jobs import CHAT_PATH, INFER_PATH, Defaults, JobFileError, Surface, parse_jobs, read_jobs


def test_text_lines_are_prompts_with_the_defaults_and_blank_lines_skipped() -> None:
    jobs = parse_jobs("First prompt\n\n   \nSecond {not json}\r\nThird\n", Defaults(max_tokens=16, temperature=0.2))
    assert [(j.index, j.line, j.prompt) for j in jobs] == [
        (0, 1, "First prompt"), (1, 4, "Second {not json}"), (2, 5, "Third")]
    assert all(j.surface is Surface.INFER and j.body == {"prompt": j.prompt, "max_tokens": 16, "temperature": 0.2}
               for j in jobs)
    assert [j.key for j in jobs] == ["index:0", "index:1", "index:2"]


def test_jsonl_fields_win_over_defaults_and_only_set_fields_are_sent() -> None:
    jobs = parse_jobs('{"prompt": "a", "max_tokens": 4, "seed": 7, "stop": "x"}\n{"prompt": "b", "id": 12}\n',
                      Defaults(max_tokens=16, model="m"))
    assert jobs[0].body == {"prompt": "a", "max_tokens": 4, "seed": 7, "stop": ["x"], "model": "m"}
    assert jobs[1].body == {"prompt": "b", "max_tokens": 16, "model": "m"}
    assert (jobs[0].id, jobs[1].id) == (None, "12")
    assert (jobs[0].key, jobs[1].key) == ("index:0", "id:12")


def test_messages_go_to_the_chat_surface() -> None:
    (job,) = parse_jobs('{"id": "c1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}')
    assert job.surface is Surface.CHAT and job.surface.value == CHAT_PATH
    assert job.body == {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    assert job.prompt is None and job.messages == [{"role": "user", "content": "Hi"}]
    assert Surface.INFER.value == INFER_PATH


@pytest.mark.parametrize(("line", "expected"), [
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens: Input should be greater than or equal to 1"),
    ('{"prompt": "a", "max_token": 5}', "max_token: Extra inputs are not permitted"),
    ('{"prompt": ""}', "prompt: String should have at least 1 character"),
    ('{"prompt": "a", "messages": []}', "give exactly one of prompt and messages"),
    ('{"max_tokens": 5}', "give exactly one of prompt and messages"),
    ('{"prompt": "a", "temperature": "hot"}', "temperature: Input should be a valid number"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_token": 5}', "max_token: not a field of a chat job"),
    ('{"messages": [{"role": "user", "content": "x"}], "stream": false}', "stream: not a field of a chat job"),
    ('{"messages": []}', "messages: List should have at least 1 item"),
    ('{"prompt": "a", "id": true}', "id: must be a string or an integer"),
    ('{"prompt": "a"', "not valid JSON"),
    ('["prompt"]', "expected a JSON object, got list"),
])
def test_a_bad_jsonl_line_is_reported_with_its_line_number(line: str, expected: str) -> None:
    with pytest.raises(JobFileError) as caught:
        parse_jobs(f'{{"prompt": "fine"}}\n\n{line}\n{{"prompt": "also fine"}}\n', source="jobs.jsonl")
    (problem,) = caught.value.problems
    assert problem.line == 3
    assert expected in problem.message
    assert str(caught.value).startswith("jobs.jsonl:3: ")


def test_every_bad_line_is_reported_at_once_including_duplicate_ids() -> None:
    text = '{"id": "a", "prompt": "x"}\n{"prompt": "y", "max_tokens": -1}\n{"id": "a", "prompt": "z"}\nnot json\n'
    with pytest.raises(JobFileError) as caught:
        parse_jobs(text)
    assert [p.line for p in caught.value.problems] == [2, 3, 4]
    assert "already used on line 1" in caught.value.problems[1].message


def test_a_text_file_with_an_out_of_range_default_reports_each_line() -> None:
    with pytest.raises(JobFileError) as caught:
        parse_jobs("a\nb\n", Defaults(temperature=9.0))
    assert [p.line for p in caught.value.problems] == [1, 2]


def test_format_detection_and_override() -> None:
    assert parse_jobs('\n{"prompt": "a"}\n')[0].prompt == "a"
    assert parse_jobs('{"prompt": "a"}\n', fmt="text")[0].prompt == '{"prompt": "a"}'
    with pytest.raises(JobFileError, match="1: not valid JSON"):
        parse_jobs("plain\n", fmt="jsonl")


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "jobs.txt"
    path.write_text("\n \n")
    with pytest.raises(JobFileError, match="no jobs"):
        read_jobs(path)


def test_a_file_that_is_not_utf8_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "jobs.txt"
    path.write_bytes(b"ok\n\xff\xfe bad\n")
    with pytest.raises(JobFileError, match="not UTF-8"):
        read_jobs(path)
