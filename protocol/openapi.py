"""Helpers for describing wire types in the services' OpenAPI documents.

Owns: turning a pydantic model into a schema that can sit inside an OpenAPI document.
Must not: define wire types (the sibling modules do).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def inlined(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with its `$defs` written in place: inside an OpenAPI document a `$ref`
    resolves from the document's root, where pydantic's `#/$defs/...` is not. (No model here is recursive.)"""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(item) for item in node]
        if not isinstance(node, dict):
            return node
        own = {key: resolve(value) for key, value in node.items() if key != "$ref"}
        if "$ref" in node:
            return {**resolve(defs[node["$ref"].rsplit("/", 1)[-1]]), **own}
        return own

    resolved: dict[str, Any] = resolve(schema)
    return resolved
