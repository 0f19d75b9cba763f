"""Wire types of the tokenizer routes, in vLLM's shapes: `POST /tokenize`, `POST /detokenize` and
`GET /tokenizer_info`.

Owns: the public request and answer bodies (a prompt, or a chat conversation rendered with the model's
template; token ids back to text), and their bounds.
Must not: reach workers. The coordinator's tokenizer surface sends `protocol.worker.TokenizeWork` to one
worker of the model and passes its `TokenizeResponse` or `DetokenizeResponse` on as it is.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.openai import ChatMessageIn
from protocol.worker import MAX_MESSAGES, MAX_PROMPT_CHARS

# Token ids one /detokenize takes: a whole context of the largest models, and then some.
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(BaseModel):
    """Exactly one of `prompt` (text) and `messages` (a chat, rendered with the model's own template, the
    assistant's turn opened, as a chat completion's prompt is)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = Field(
        default=None, description="the model's own begin-of-text token(s) first; default: true for a prompt, false "
        "for messages (the template writes them)")
    add_generation_prompt: bool = Field(default=True, description="messages: the assistant's turn opened (only "
                                        "true is supported: it is what a chat completion's prompt is)")
    return_token_strs: bool = Field(default=False, description="also each token's text (`token_strs`)")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int = Field(ge=0, description="the number of tokens")
    max_model_len: int = Field(ge=1, description="the most tokens one session of the model holds (prompt + output)")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, description="each token's text, a partial UTF-8 character "
                                         "as U+FFFD; only with return_token_strs")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(default=None, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class TokenizerInfoRequest(BaseModel):
    """Which model's tokenizer (`GET /tokenizer_info?model=`; the coordinator posts it to a worker)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, max_length=256)


class TokenizerInfo(BaseModel):
    """What a client needs to tokenize as the model does, as vLLM's `/tokenizer_info` gives it (the fields
    an evaluation harness's remote tokenizer reads: lm-evaluation-harness checks for `eos_token`)."""

    tokenizer_class: str = Field(description="`llama.cpp/` and the GGUF's tokenizer model (`gpt2`, `llama`, ...)")
    bos_token: str | None = Field(description="the begin-of-text token's text; None when the model has none")
    eos_token: str | None = Field(description="the end-of-text token's text; None when the model has none")
    pad_token: str | None = None
    add_bos_token: bool = Field(description="a prompt's tokens start with `bos_token` (`add_special_tokens`)")
    chat_template: str | None = Field(description="the GGUF's Jinja chat template, None without one")
    model_max_length: int = Field(ge=1, description="the most tokens one session of the model holds")
    vocab_size: int = Field(ge=1)


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the tokens' text (special tokens as empty text)")
