"""The OpenAPI document as the server really behaves, so that a schema-driven fuzzer's conformance
checks hold: errors as they are answered, every schema resolvable, path parameters as constrained as
the server constrains them."""

from __future__ import annotations

import json

from fastapi import FastAPI

from .runtime.models.records import MODEL_NAME

PATH_PARAMETERS = {
    "name": {
        "schema": {"type": "string", "pattern": MODEL_NAME.pattern},
        "description": "the model's name; device names such as con or nul are refused",
        "example": "demo",
    },
    "version": {"schema": {"type": "string", "pattern": "^[0-9]+$"}, "example": "1"},
}


def finish_openapi(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _finished(generate())
        return app.openapi_schema

    app.openapi = openapi


def _finished(schema: dict) -> dict:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for item in schema["paths"].values():
        for operation in item.values():
            # Request validation errors answer 400 {"error": ...}, not FastAPI's 422 HTTPValidationError.
            responses = operation.get("responses", {})
            if "HTTPValidationError" in str(responses.get("422", "")):
                del responses["422"]
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] in PATH_PARAMETERS:
                    parameter.update(PATH_PARAMETERS[parameter["name"]])
            # Request bodies written from pydantic's model_json_schema keep their own $defs.
            for content in operation.get("requestBody", {}).get("content", {}).values():
                components.update(content.get("schema", {}).pop("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return json.loads(json.dumps(schema).replace('"#/$defs/', '"#/components/schemas/'))
