from pathlib import Path

import pytest

from worker.backends.base import ModelShape, file_identity
from worker.sessions.messages import Message

pytestmark = pytest.mark.model


def test_kv_bytes_per_token_comes_from_the_models_shape(model) -> None:  # type: ignore[no-untyped-def]
    shape = model.shape
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; K and V in f16 -> 30*3*(64+64)*2 = 23040 bytes.
    assert (shape.n_layer, shape.n_head_kv, shape.head_dim_k, shape.head_dim_v) == (30, 3, 64, 64)
    assert model.bytes_per_token == 23040


def test_kv_formula() -> None:
    shape = ModelShape(n_layer=22, n_head=32, n_head_kv=4, n_embd=2048, head_dim_k=64, head_dim_v=64,
                       n_ctx_train=2048, n_vocab=32000)  # TinyLlama 1.1B's shape
    assert shape.kv_bytes_per_token(2) == 22 * 4 * 128 * 2


def test_chat_template_and_tokens(model) -> None:  # type: ignore[no-untyped-def]
    rendered = model.render_chat([Message("user", "Hi")])
    # The GGUF's own Jinja template, with its default system prompt (tests/worker/backends/test_chat_template.py)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    tokens = model.tokenize(rendered, add_special=True)
    pieces = b"".join(model.piece(t) for t in tokens)  # specials render empty
    assert pieces.startswith(b"system\nYou are") and pieces.endswith(b"user\nHi\nassistant\n")
    assert model.eog_tokens and all(model.is_eog(t) for t in model.eog_tokens)


def test_a_model_files_identity_is_stable_and_tells_models_apart(model_path: Path, gemma_path: Path,
                                                                  tmp_path: Path) -> None:

    assert file_identity(model_path) == file_identity(model_path)
    assert file_identity(model_path) != file_identity(gemma_path)
    renamed = tmp_path / "renamed.gguf"
    renamed.symlink_to(model_path)
    assert file_identity(renamed) == file_identity(model_path)  # the content decides, not the name
