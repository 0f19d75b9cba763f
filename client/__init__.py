"""The batch client: pushes a file of prompts through a running pool and writes one result per job.

    python -m client batch JOBS --url URL --output RESULTS.jsonl      (or the `llm-batch` script)

Modules, one concern each:
- `jobs`: reads a jobs file (one prompt per line, or JSONL with parameters) into validated `Job`s;
- `results`: the results file: one JSON line per job, what a rerun may skip, compaction;
- `retry`: when to try a refused request again, and how long to wait first (pure);
- `stream`: one job over HTTP: the request, the SSE stream, the retries;
- `progress`: the live tallies and their rich rendering, overall and per worker;
- `batch`: runs the jobs with bounded concurrency and writes the results;
- `__main__`: the command line.

The client depends on the pool's public contract only (`protocol/inference.py`, `protocol/openai.py`),
never on the coordinator's or workers' code.
"""
