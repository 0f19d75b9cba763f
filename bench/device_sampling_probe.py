"""Default sampling in llama.cpp's graph ("backend sampling") against the worker's numpy sampler, in one
process, on one model: what a step costs each way, and what changing one sequence's sampler costs.

Owns: the probe's context, its decode loop and the lines it prints.
Must not: touch the worker; it imports only the worker's sampler, to time the host side as the worker
samples.

Both ways decode the same batches: N sequences, a short prompt each, then `--steps` steps of one token
per sequence. Every sequence samples with the request defaults (temperature 0.8, top-k 40, top-p 0.95),
seeded by its index, without the probability the token events of `/coordinator/infer` carry (the
graph's sampler does not give the raw softmax's):
  host     llama.cpp hands back the logits matrix; `StepSampler.sample` draws every row (the worker's path)
  device   each sequence has a llama.cpp sampler chain (top-k, top-p, temperature, dist) given to the
           context at its creation (`llama_context_params.samplers`); the graph samples, and only the
           token ids are read (`llama_get_sampled_token_ith`)
Then, in the device way, one sequence's sampler is replaced by another (`llama_set_sampler`), as a new
request with other parameters would need, and the next decode is timed against the ones before.

    .venv/bin/python -m bench.device_sampling_probe [--model PATH] [--sequences 64] [--steps 100]
                                                    [--threads 1] [--gpu-layers 0]

The default model is bench.tiny_model's (its decode is cheap, so sampling shows); `--gpu-layers 999`
puts every layer on a GPU where llama.cpp was built for one.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.tiny_model import DEFAULT_OUT, ensure_tiny_model

PROMPT_TOKENS = 8
DEFAULTS = (0.8, 40, 0.95)  # temperature, top-k, top-p: what a request that names none gets


def chain(ll: Any, seed: int) -> Any:
    temperature, top_k, top_p = DEFAULTS
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_top_k(top_k))
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_top_p(top_p, 1))
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_temp(temperature))
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_dist(seed))
    return sampler


def run(model_path: Path, n: int, steps: int, threads: int, gpu_layers: int, device: bool) -> dict[str, float]:
    import llama_cpp as ll
    import numpy as np

    from worker.engine.sampling import RequestSampling, SamplingParams, StepSampler

    ll.llama_backend_init()
    model_params = ll.llama_model_default_params()
    model_params.n_gpu_layers = gpu_layers
    model = ll.llama_model_load_from_file(str(model_path).encode(), model_params)
    params = ll.llama_context_default_params()
    params.n_ctx = (PROMPT_TOKENS + steps + 8) * n
    params.n_batch = params.n_ubatch = PROMPT_TOKENS * n
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = False
    params.no_perf = True
    chains = [chain(ll, seed) for seed in range(n)] if device else []
    if device:
        configs = (ll.llama_sampler_seq_config * n)()
        for seq, each in enumerate(chains):
            configs[seq].seq_id = seq
            configs[seq].sampler = ctypes.cast(each, ctypes.c_void_p)
        params.samplers, params.n_samplers = configs, n
    ctx = ll.llama_init_from_model(model, params)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(params.n_batch, 0, 1)
    sampler = StepSampler(n_vocab)
    temperature, top_k, top_p = DEFAULTS
    requests = [RequestSampling(SamplingParams(temperature, top_p, top_k, seed, probability=False))
                for seed in range(n)]

    def put(row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
        batch.seq_id[row][0], batch.logits[row] = seq, logits

    def sampled(outputs: list[int]) -> list[int]:
        """The graph's token for each of the batch's `outputs`; llama.cpp answers -1 where it sampled none."""
        tokens = [ll.llama_get_sampled_token_ith(ctx, i) for i in outputs]
        if min(tokens) < 0 or max(tokens) >= n_vocab:
            raise RuntimeError(f"llama.cpp's graph sampled no token for some sequence: {tokens}")
        return tokens

    def decode(rows: int) -> float:
        batch.n_tokens = rows
        started = time.perf_counter()
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - started

    for seq in range(n):
        for pos in range(PROMPT_TOKENS):
            put(seq * PROMPT_TOKENS + pos, 1 + (seq + pos) % 100, pos, seq, pos == PROMPT_TOKENS - 1)
    decode(n * PROMPT_TOKENS)
    outputs = [seq * PROMPT_TOKENS + PROMPT_TOKENS - 1 for seq in range(n)]
    decode_s = sample_s = 0.0
    cpu = time.process_time()
    for step in range(steps):
        started = time.perf_counter()
        if device:
            tokens = sampled(outputs)
        else:
            logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(n, n_vocab))
            tokens = [token for token, _ in sampler.sample(logits, requests)]
        sample_s += time.perf_counter() - started
        for seq, token in enumerate(tokens):
            put(seq, token, PROMPT_TOKENS + step, seq, True)
        outputs = list(range(n))
        decode_s += decode(n)
    cpu = time.process_time() - cpu
    result = {"decode_us": decode_s / steps / n * 1e6, "read_or_sample_us": sample_s / steps / n * 1e6,
              "cpu_us": cpu / steps / n * 1e6, "tokens_per_s": steps * n / (decode_s + sample_s)}
    if device:  # a new request with other parameters on sequence 0: one sampler replaced
        tokens = sampled(outputs)  # the last step's, sampled by the chains the context began with
        replacement = chain(ll, 12345)
        chains.append(replacement)  # freed with the others, after the context
        started = time.perf_counter()
        if not ll.llama_set_sampler(ctx, 0, replacement):
            raise RuntimeError("llama.cpp would not put the replacement sampler in its graph")
        set_s = time.perf_counter() - started
        for seq, token in enumerate(tokens):
            put(seq, token, PROMPT_TOKENS + steps, seq, True)
        result["set_sampler_ms"] = set_s * 1e3
        result["decode_after_set_ms"] = decode(n) * 1e3
        result["decode_step_ms"] = decode_s / steps * 1e3
        sampled(outputs)  # sequence 0's token now comes from the replacement
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    for each in chains:
        ll.llama_sampler_free(each)
    ll.llama_model_free(model)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: bench.tiny_model's, written if absent")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--way", choices=("host", "device"), default=None, help="one way only (a child run)")
    args = parser.parse_args(argv)
    model = args.model or (DEFAULT_OUT if DEFAULT_OUT.exists() else ensure_tiny_model())
    if args.way is not None:
        figures = run(model, args.sequences, args.steps, args.threads, args.gpu_layers, args.way == "device")
        print(" ".join(f"{key}={value:.2f}" for key, value in figures.items()))
        return 0
    print(f"{model.name}: {args.sequences} sequences x {args.steps} steps, {args.threads} llama.cpp thread(s), "
          f"{args.gpu_layers} GPU layers; default sampling (temperature, top-k, top-p = {DEFAULTS})")
    for way in ("host", "device"):  # each in its own process: llama.cpp's log and state stay apart
        child = subprocess.run([sys.executable, "-m", "bench.device_sampling_probe", "--model", str(model),
                                "--sequences", str(args.sequences), "--steps", str(args.steps),
                                "--threads", str(args.threads), "--gpu-layers", str(args.gpu_layers),
                                "--way", way], capture_output=True, text=True, check=False)
        lines = child.stdout.strip().splitlines()
        print(f"  {way:<6} {lines[-1] if child.returncode == 0 and lines else 'failed: ' + child.stderr[-400:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
