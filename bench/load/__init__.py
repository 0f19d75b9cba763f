"""Load-test tool: drive a streaming LLM endpoint with a closed or open loop and measure it.

    .venv/bin/python -m bench.load --url http://127.0.0.1:1337 --api infer --concurrency 1,8,16 \\
        --requests 32 --max-tokens 64 --out results.json --plot results.png

Modules, one job each: `workload` (who sends what when), `sse` and `clients` (one streaming request,
timed), `record` (what one request measured), `runner` (one point of a sweep), `stats` (percentiles,
throughput, goodput), `report` (table and JSON), `plot` (PNG), `peer` and `compare` (the same workload
against `llama_cpp.server`), `cli` (flags). Targets are loopback only.
"""
