"""The OpenAPI document as fleet answers: an invalid request is a 400 with
OpenAI's error body, not FastAPI's 422 with its list of validation errors."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from fleet.frontend.protocol import ErrorResponse

FASTAPI_ERROR_SCHEMAS = ("HTTPValidationError", "ValidationError")
"""What only FastAPI's 422 responses refer to."""


def document_fleet_errors(app: FastAPI) -> None:
    """Make `app` serve, at /openapi.json, FastAPI's document with each 422 response replaced by fleet's 400."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _replace_validation_errors(generate())  # generate() keeps what it made in app.openapi_schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _replace_validation_errors(document: dict[str, Any]) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error.pop("$defs", {}))
    schemas["ErrorResponse"] = error
    bad_request = {"description": "Bad Request: the error names the parameter (`param`)",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = bad_request
    for name in FASTAPI_ERROR_SCHEMAS:
        schemas.pop(name, None)
