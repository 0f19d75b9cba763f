"""The loaded GGUF model: weights, vocabulary, chat template and the facts admission needs.

Owns: loading a model through llama.cpp's low-level API, tokenizing, rendering chat prompts,
turning tokens into bytes (a table built once at load), and the KV bytes one token takes (read from
the model's own shape).
Must not: own a decode context or run inference; the engine does. Everything here only reads the
model and vocabulary, which llama.cpp allows from any thread, so the asyncio side may tokenize
(in a worker thread) while the engine thread decodes.
"""

from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path
from typing import Any

import jinja2
import llama_cpp as ll

from protocol.worker import ToolUse
from worker.backends.base import PLAIN_TURN_STOP, ModelShape, SpecialTokens, file_identity, plain_turns
from worker.backends.chat_template import ChatTemplate
from worker.backends.tool_format import ToolFormat, format_of
from worker.engine.grammar import Grammar, GrammarCompiler, LazyGrammar
from worker.sessions.messages import Message

_log = logging.getLogger("worker.llama")
_GGML_LOG_LEVEL_WARN = 3
_GGML_LOG_LEVEL_CONT = 5


# What llama.cpp says of a step the engine cut short on purpose (worker/backends/llama_interrupt.py).
_CUT_STEP = (b"graph_compute: ggml_backend_sched_graph_compute_async failed with error 1",
             b"process_ubatch: failed to compute graph, compute status: 1", b"decode: removing memory module entries",
             b"llama_decode: failed to decode, ret = 2")


def _forward_llama_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp logs every tensor at load time; keep warnings and errors only.
    if _GGML_LOG_LEVEL_WARN <= level < _GGML_LOG_LEVEL_CONT and not text.startswith(_CUT_STEP):
        _log.warning("%s", text.decode("utf-8", errors="replace").rstrip())


# A ctypes callback must outlive every call into llama.cpp, so it is created once, here.
_LLAMA_LOG_CALLBACK = ll.llama_log_callback(_forward_llama_log)

# llama.cpp offloads min(this, the model's layers + output): "all of them" without knowing the model yet.
ALL_LAYERS = 1 << 30

# ggml element sizes (bytes per value) of the cache types we allow.
KV_ELEMENT_BYTES = {ll.GGML_TYPE_F16: 2, ll.GGML_TYPE_F32: 4}


class Model:
    """A GGUF model loaded once per worker process."""

    def __init__(self, path: Path, *, kv_type: int = ll.GGML_TYPE_F16, gpu_layers: int = -1) -> None:
        """`gpu_layers`: layers whose weights (and KV cache) llama.cpp puts on the GPU; -1: every layer
        when this llama.cpp build can offload (a CUDA or Metal build), none on a CPU-only build."""
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        if kv_type not in KV_ELEMENT_BYTES:
            raise ValueError(f"unsupported KV cache type {kv_type}")
        ll.llama_log_set(_LLAMA_LOG_CALLBACK, ctypes.c_void_p(0))
        ll.llama_backend_init()  # idempotent: timers and lookup tables only
        params = ll.llama_model_default_params()
        supported = bool(ll.llama_supports_gpu_offload())
        self.gpu_layers = (ALL_LAYERS if supported else 0) if gpu_layers < 0 else gpu_layers
        self.backend = "gpu" if supported and self.gpu_layers > 0 else "cpu"
        params.n_gpu_layers = self.gpu_layers
        self._handle = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self._handle:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.path = path
        self.name = path.stem
        self.identity = file_identity(path)
        self.kv_type = kv_type
        self.vocab = ll.llama_model_get_vocab(self._handle)
        self.shape = self._read_shape()
        self.bytes_per_token = self.shape.kv_bytes_per_token(KV_ELEMENT_BYTES[kv_type])
        self.eog_tokens = tuple(t for t in range(self.shape.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t))
        self._eog = frozenset(self.eog_tokens)  # checked for every generated token: no ctypes call
        self.grammars = GrammarCompiler(self._grammar_tokenizer, self.shape.n_vocab, int(ll.llama_vocab_eos(self.vocab)))
        template = ll.llama_model_chat_template(self._handle, None)
        self._chat_template: bytes | None = template or None
        self._jinja = self._compile(self._chat_template)
        # A template's own tool section is used only through Jinja (llama.cpp's matcher writes no tools).
        self.tool_format: ToolFormat = format_of(self._chat_template.decode("utf-8", errors="replace")
                                                 if self._jinja is not None and self._chat_template else None)
        # Every token's bytes, read once: the engine turns each generated token into text, and a table
        # lookup costs a fraction of a llama_token_to_piece call through ctypes (about 0.1 s at load for
        # a 49,152-token vocabulary).
        self._pieces = self._read_pieces()
        self.max_token_bytes = max(1, max(map(len, self._pieces), default=1))

    @property
    def handle(self) -> ll.llama_model_p:
        return self._handle

    def meta_str(self, key: str) -> str | None:
        """A GGUF metadata value as text (e.g. `general.name`), None when the file has no such key."""
        buf = ctypes.create_string_buffer(512)
        if ll.llama_model_meta_val_str(self._handle, key.encode(), buf, len(buf)) < 0:
            return None
        return buf.value.decode("utf-8", errors="replace")

    def _meta_int(self, key: str) -> int | None:
        buf = ctypes.create_string_buffer(64)
        if ll.llama_model_meta_val_str(self._handle, key.encode(), buf, len(buf)) < 0:
            return None
        try:
            return int(buf.value.decode())
        except ValueError:
            return None

    def _read_shape(self) -> ModelShape:
        n_head = ll.llama_model_n_head(self._handle)
        n_embd = ll.llama_model_n_embd(self._handle)
        arch_buf = ctypes.create_string_buffer(64)
        ll.llama_model_meta_val_str(self._handle, b"general.architecture", arch_buf, len(arch_buf))
        arch = arch_buf.value.decode()
        # Head sizes are explicit in the metadata of models whose heads are not n_embd / n_head.
        head_k = self._meta_int(f"{arch}.attention.key_length") or n_embd // n_head
        head_v = self._meta_int(f"{arch}.attention.value_length") or n_embd // n_head
        return ModelShape(
            n_layer=ll.llama_model_n_layer(self._handle),
            n_head=n_head,
            n_head_kv=ll.llama_model_n_head_kv(self._handle),
            n_embd=n_embd,
            head_dim_k=head_k,
            head_dim_v=head_v,
            n_ctx_train=ll.llama_model_n_ctx_train(self._handle),
            n_vocab=ll.llama_vocab_n_tokens(self.vocab),
            n_swa=max(0, ll.llama_model_n_swa(self._handle)),
        )

    # -- text <-> tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        tokens = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, True)
        if n < 0:  # buffer too small: llama.cpp returns minus the size it needs
            capacity = -n
            tokens = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, True)
        return list(tokens[:n])

    def piece(self, token: int) -> bytes:
        """The raw bytes of one token; may be part of a multi-byte UTF-8 character. Special tokens
        (end of turn and the like) render empty."""
        return self._pieces[token]

    def _read_pieces(self) -> tuple[bytes, ...]:
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for token in range(self.shape.n_vocab):
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                bigger = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self.vocab, token, bigger, len(bigger), 0, False)
                pieces.append(bigger.raw[:n])
            else:
                pieces.append(buf.raw[:n])
        return tuple(pieces)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    # -- prompts -----------------------------------------------------------------------------------

    @property
    def turn_stop(self) -> str | None:
        """Text that ends an assistant turn when there is no template to end it with a token."""
        return PLAIN_TURN_STOP if self._chat_template is None else None

    def _compile(self, template: bytes | None) -> ChatTemplate | None:
        """The GGUF's Jinja template, compiled; None without one, or (logged) when it does not compile."""
        if template is None:
            return None
        bos, eos = ll.llama_vocab_bos(self.vocab), ll.llama_vocab_eos(self.vocab)
        try:
            return ChatTemplate(template.decode("utf-8", errors="replace"), bos=self._special_text(bos),
                                eos=self._special_text(eos), strip_bos=bool(ll.llama_vocab_get_add_bos(self.vocab)))
        except jinja2.TemplateError as exc:
            _log.warning(json.dumps({"event": "chat_template_not_compiled", "model": self.name, "detail": str(exc),
                                    "fallback": "llama.cpp's built-in template matcher"}))
            return None

    def special_tokens(self) -> SpecialTokens:
        bos, eos = int(ll.llama_vocab_bos(self.vocab)), int(ll.llama_vocab_eos(self.vocab))
        return SpecialTokens(kind=self.meta_str("tokenizer.ggml.model") or "unknown",
                             bos=self._special_text(bos) if bos >= 0 else None,
                             eos=self._special_text(eos) if eos >= 0 else None,
                             add_bos=bool(ll.llama_vocab_get_add_bos(self.vocab)),
                             chat_template=self._chat_template.decode("utf-8", errors="replace")
                             if self._chat_template else None)

    def _special_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = ll.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    def render_chat(self, messages: list[Message], tools: ToolUse | None = None) -> str:
        """The conversation as the model expects it, ending with the assistant's turn opened: by the
        model's own Jinja template (`TemplateRefusal` when the template refuses it), else llama.cpp's
        built-in matcher, else plain `role: text` turns; tools, calls and their results as the model's
        tool format writes them (`tool_format`)."""
        turns, listed = self.tool_format.turns(messages, tools)
        if self._jinja is not None:
            return self._jinja.render(turns, tools=listed)
        if self._chat_template is None:
            return plain_turns(turns)
        keep = [(t["role"].encode(), t["content"].encode()) for t in turns]
        chat = (ll.llama_chat_message * len(keep))(*(ll.llama_chat_message(r, c) for r, c in keep))
        size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = ll.llama_chat_apply_template(self._chat_template, chat, len(keep), True, buf, size)
            if n < 0:
                raise ValueError("the model's chat template is not supported by llama.cpp")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise RuntimeError("chat template output kept growing")

    def constraint(self, *, grammar: str | None, json_schema: dict[str, Any] | None,
                   lazy: bool = False) -> Grammar | LazyGrammar | None:
        return self.grammars.compile(grammar=grammar, json_schema=json_schema, lazy=self.piece if lazy else None)

    def _grammar_tokenizer(self) -> Any:
        """This model's vocabulary as llguidance reads it: each token's bytes, a control token's (and a
        user-defined `<...>` one's) marked with a leading 0xff so that no text can produce it, and
        llama.cpp's own tokenizer for the text llguidance must split."""
        import llguidance

        tokens = []
        buf = ctypes.create_string_buffer(1024)
        for token in range(self.shape.n_vocab):
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)  # specials as their text
            if n < 0:
                raise ValueError(f"token {token} is longer than {len(buf)} bytes")
            piece = buf.raw[:n]
            attr = ll.llama_vocab_get_attr(self.vocab, token)
            if attr & ll.LLAMA_TOKEN_ATTR_CONTROL or (attr & ll.LLAMA_TOKEN_ATTR_USER_DEFINED
                                                       and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            tokens.append(piece)
        tokenize = ctypes.cast(ll.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
        # The binding has it; its type stubs do not list it (llguidance's own llamacpp.py ignores it too).
        make = llguidance.LLTokenizer.from_llamacpp  # type: ignore[attr-defined]
        return make(tokens=tokens, vocab_ptr=self.vocab, tokenize_fptr=tokenize,
                    eos_token=int(ll.llama_vocab_eos(self.vocab)), slices=None)

    def close(self) -> None:
        if self._handle:
            ll.llama_model_free(self._handle)
            self._handle = None
