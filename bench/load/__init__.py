"""Load-test tool: drive a streaming LLM endpoint with a closed or open loop and measure it.

    .venv/bin/python -m bench.load --url http://127.0.0.1:1337 --api infer --concurrency 1,8,16 \\
        --requests 32 --max-tokens 64 --out results.json --plot results.png

`--api openai-chat` sends the same workload to the coordinator's OpenAI `POST /v1/chat/completions`
instead, so the two surfaces can be compared point by point.

Modules, one job each: `workload` (what is sent when: seeded prompts, closed and open loops), `sse`
and `clients` (one timed streaming request per API), `record` (what one request measured), `runner`
(one point of a sweep), `stats` (percentiles, throughput, goodput), `report` (tables, JSON), `plot`
(PNG), `peer` and `compare` (the same workload against `llama_cpp.server` or llama.cpp's `llama-server`), `cli` (flags) and
`command` (a run from start to end). Targets are loopback only.

Short points measure edges: a closed-loop point's wall time includes the requests still running at
its deadline, so give each point many request lifetimes (`--duration`) or enough `--requests`.
"""
