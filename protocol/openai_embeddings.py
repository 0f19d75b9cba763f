"""Wire types of OpenAI's embeddings API: `POST /v1/embeddings`.

Owns: the request body as OpenAI documents it (unknown fields ignored, as on the other OpenAI routes)
and the `list` of `embedding` objects with its usage, as the official clients parse them.
Must not: reach workers. The coordinator's embeddings surface maps these onto `protocol.worker.EmbedRequest`.

`input` takes every form OpenAI's API takes, so that a body the official client sends always parses;
the surface refuses the token-id forms by name (`coordinator/surfaces/embeddings.py` says why).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.worker import MAX_EMBED_DIMENSIONS, MAX_EMBED_INPUTS, MAX_PROMPT_CHARS

Text = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
TokenIds = Annotated[list[int], Field(max_length=MAX_PROMPT_CHARS)]


class EmbeddingRequest(BaseModel):
    """Strict types, as OpenAI's own API checks them: `"5"` is not a number."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: Text | Annotated[list[Text] | list[int] | list[TokenIds], Field(max_length=MAX_EMBED_INPUTS)]
    model: str | None = Field(default=None, max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_EMBED_DIMENSIONS)
    user: str | None = Field(default=None, max_length=256)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int = Field(ge=0, description="the input's position in the request")
    embedding: list[float] | str = Field(description="unit length; with `encoding_format: base64`, base64 of "
                                         "little-endian float32 values")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(ge=0, description="tokens of every input, as the model tokenized them")
    total_tokens: int = Field(ge=0)


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
