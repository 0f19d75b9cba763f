"""Writes a tiny random-weight llama GGUF with a real tokenizer, for measuring the worker's own overhead.

Owns: the tiny model's shape, its random weights (seeded, so two runs write the same file) and copying
the tokenizer (vocabulary, merges, special tokens, chat template) from a real GGUF.
Must not: be used for anything that needs sensible text; the weights are noise.

On this model `llama_decode` is nearly free (2 layers of 64 units; the output projection onto the
49,152-token vocabulary is most of it), so a worker step is mostly the Python around it, as it is when a
GPU does the decoding. The vocabulary, and so the logits matrix the sampler reads, has the real size.

    .venv/bin/python -m bench.tiny_model [--source modelFiles/SmolLM2-135M-Instruct.Q4_1.gguf] [--out PATH]

`--shape tinyllama` writes TinyLlama-1.1B's shape instead (22 layers of 2,048 units, 32 heads, 4 of them
KV heads, a feed-forward of 5,632; about 1.1 billion weights with SmolLM2's 49,152-token vocabulary, stored
as F16): random weights, for measuring a GPU's decoding where no real weights may be downloaded
(bench/gpu_check.sh). Its text is noise, its cost per token a real 1.1B model's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from worker.provision import DEFAULT_MODEL_PATH

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "tiny-llama-2x64.gguf"
ARCH = "llama"


@dataclass(frozen=True)
class TinyShape:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 4096
    # Output weights' spread: logits with a standard deviation of about sqrt(n_embd) x this (4 here),
    # the order of a trained model's, so softmax sums and top-p cuts see a realistic distribution.
    output_scale: float = 0.5
    name: str = "tiny-llama-2x64-random"
    # The matrices' storage: the tiny model's output projection is Q8_0 (as a quantized model's is) and
    # its other matrices F32; a large shape stores every matrix as F16, which numpy writes at once.
    f16: bool = False


SHAPES = {
    "tiny": TinyShape(),
    "tinyllama": TinyShape(n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632, n_ctx_train=2048,
                           output_scale=4 / np.sqrt(2048), name="tinyllama-1.1b-shaped-random", f16=True),
}


def tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """Every `tokenizer.*` key of `source`, as (key, value, type, element type of an array)."""
    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return out


def write_tiny_model(source: Path, out: Path, shape: TinyShape = TinyShape(), seed: int = 0, *,
                     chat_template: str | None = None) -> Path:
    """`chat_template`: the model's template in place of the source's (tests give one of their own)."""
    fields = tokenizer_fields(source)
    if chat_template is not None:
        fields = [(k, chat_template if k == "tokenizer.chat_template" else v, t, sub) for k, v, t, sub in fields]
    n_vocab = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens" and isinstance(v, list))
    head_dim = shape.n_embd // shape.n_head
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, scale: float) -> np.ndarray:
        # gguf stores a (rows, cols) numpy array as a ggml tensor of ne = [cols, rows]: y = W x.
        if not shape.f16:  # float64 draws: the tiny model's file stays the one earlier measurements used
            return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        drawn = rng.standard_normal((rows, cols), dtype=np.float32)
        drawn *= scale
        return drawn.astype(np.float16)

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, ARCH)
    writer.add_name(shape.name)
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if shape.f16 else gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value, vtype, sub in fields:
        writer.add_key_value(key, value, vtype, sub_type=sub)

    d, kv = shape.n_embd, shape.n_head_kv * head_dim
    inner = 1.0 / np.sqrt(d)
    writer.add_tensor("token_embd.weight", weight(n_vocab, d, 1.0))
    for i in range(shape.n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(d, d, inner))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, d, inner))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, d, inner))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(d, d, inner))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(shape.n_ff, d, inner))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(shape.n_ff, d, inner))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(d, shape.n_ff, 1.0 / np.sqrt(shape.n_ff)))
    writer.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    output = weight(n_vocab, d, shape.output_scale)
    if shape.f16:
        writer.add_tensor("output.weight", output)
    else:  # Q8_0, as a quantized model's output is: about 3x less time in the vocabulary projection than F32
        writer.add_tensor("output.weight", gguf.quants.quantize(output, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def ensure_tiny_model(source: Path = DEFAULT_MODEL_PATH, out: Path = DEFAULT_OUT) -> Path:
    """The tiny model's path, written first if it is not there yet."""
    return out if out.is_file() else write_tiny_model(source, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiny_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=DEFAULT_MODEL_PATH, help="GGUF whose tokenizer is copied")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args(argv)
    path = write_tiny_model(args.source, args.out, SHAPES[args.shape], seed=args.seed)
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
