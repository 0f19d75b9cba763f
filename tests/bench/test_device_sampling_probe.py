"""bench.device_sampling_probe: both ways decode and sample through the llama.cpp that is installed."""

from __future__ import annotations

from pathlib import Path

from bench.device_sampling_probe import run
from bench.tiny_model import ensure_tiny_model


def test_both_ways_sample_and_the_device_way_replaces_a_sequences_sampler(tmp_path: Path) -> None:
    model = ensure_tiny_model(out=tmp_path / "tiny.gguf")
    host = run(model, n=4, steps=3, threads=1, gpu_layers=0, device=False)
    device = run(model, n=4, steps=3, threads=1, gpu_layers=0, device=True)
    assert host["decode_us"] > 0 and host["read_or_sample_us"] > 0 and "set_sampler_ms" not in host
    # The graph samples: reading a token is a lookup, and a replaced sampler is decoded with.
    assert device["decode_us"] > 0 and device["decode_after_set_ms"] > 0 and device["set_sampler_ms"] >= 0
