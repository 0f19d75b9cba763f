"""bench.device_sampling_probe: both ways decode and sample through the llama.cpp that is installed."""

from __future__ import annotations

from pathlib import Path

from bench.device_sampling_probe import run
from bench.tiny_model import ensure_tiny_model


def test_both_ways_sample_and_the_device_way_replaces_a_sequences_sampler(tmp_path: Path) -> None:
    """`run` raises where llama.cpp's graph samples no token for a sequence, before or after one
    sequence's sampler is replaced, or refuses the replacement; each way reports only its own figures."""
    model = ensure_tiny_model(out=tmp_path / "tiny.gguf")
    host = run(model, n=4, steps=3, threads=1, gpu_layers=0, device=False)
    device = run(model, n=4, steps=3, threads=1, gpu_layers=0, device=True)
    common = {"decode_us", "read_or_sample_us", "cpu_us", "tokens_per_s"}
    assert set(host) == common
    assert set(device) == common | {"set_sampler_ms", "decode_after_set_ms", "decode_step_ms"}
