"""The random-weight models' shapes: the tiny one is unchanged, the GPU check's is TinyLlama-1.1B's."""

from __future__ import annotations

from bench.tiny_model import SHAPES, TinyShape

N_VOCAB = 49_152  # SmolLM2's tokenizer, which both copy


def weights(shape: TinyShape) -> int:
    d, kv = shape.n_embd, shape.n_head_kv * (shape.n_embd // shape.n_head)
    per_layer = 2 * d * d + 2 * kv * d + 3 * shape.n_ff * d + 2 * d
    return 2 * N_VOCAB * d + shape.n_layer * per_layer + d


def test_the_tiny_shape_is_the_one_earlier_measurements_used() -> None:
    tiny = SHAPES["tiny"]
    assert (tiny.n_layer, tiny.n_embd, tiny.n_head, tiny.n_head_kv, tiny.n_ff) == (2, 64, 4, 2, 128)
    assert not tiny.f16 and tiny == TinyShape()


def test_the_gpu_shape_is_tinyllamas_with_about_a_billion_weights_in_f16() -> None:
    big = SHAPES["tinyllama"]
    assert (big.n_layer, big.n_embd, big.n_head, big.n_head_kv, big.n_ff) == (22, 2048, 32, 4, 5632)
    assert big.f16
    # TinyLlama's 1.10 billion with its 32,000-token vocabulary; SmolLM2's larger one adds 0.07.
    assert 1.1e9 < weights(big) < 1.2e9
    # Logits of about the spread of the tiny model's (sqrt(n_embd) x output_scale = 4).
    assert abs(big.n_embd ** 0.5 * big.output_scale - 4.0) < 1e-9
