"""MkDocs hook: the reference pages' tables are generated from the code as the site builds, so they
cannot drift from it. A page asks for one with a marker line, ``<!-- generated: settings -->``:

- ``settings``: every field of ``server.settings.Settings`` (its variable, flag, type, default, docstring);
- ``metrics``: every collector of ``server.runtime.observability.metrics.Metrics`` (name, type, labels, help);
- ``model-config``: every field of the upload config, ``server.runtime.models.records.ModelConfig``;
- ``http-api``: every route of the REST API, from the app's OpenAPI document;
- ``readme``: the repository's README (the site's home page), its links made relative to ``docs/``.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda match: GENERATORS[match.group(1)](), markdown)


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("pathlib.", "")


def settings_table() -> str:
    from pydantic_core import PydanticUndefined

    from server.settings import Settings

    rows = ["| variable | flag of `jitserve serve` | type | default | what it sets |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = "" if field.default is PydanticUndefined else f"`{field.default!r}`"
        flag = "--" + name.replace("_", "-")
        rows.append(
            f"| `JITSERVE_{name.upper()}` | `{flag}` | `{_cell(_type(field.annotation))}` | {_cell(default)} "
            f"| {_cell(field.description or '')} |"
        )
    return "\n".join(rows)


def metrics_table() -> str:
    from server.runtime.observability.metrics import Metrics

    metrics = Metrics()
    # The registry's collectors (prometheus_client keeps them by collector; its version is pinned).
    collectors = sorted(metrics.registry._collector_to_names, key=lambda c: c._name)
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for collector in collectors:
        name = collector._name + ("_total" if collector._type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in collector._labelnames)
        rows.append(f"| `{name}` | {collector._type} | {labels} | {_cell(collector._documentation)} |")
    return "\n".join(rows)


def model_config_table() -> str:
    from server.runtime.models.records import ModelConfig

    rows = ["| field | type | what it sets |", "|---|---|---|"]
    for name, field in ModelConfig.model_fields.items():
        rows.append(f"| `{name}` | `{_cell(_type(field.annotation))}` | {_cell(field.description or '')} |")
    return "\n".join(rows)


def http_api_table() -> str:
    from server.app import create_app
    from server.settings import Settings

    with tempfile.TemporaryDirectory() as data_dir:
        spec = create_app(Settings(data_dir=data_dir, demo_model=False, grpc_port=0)).openapi()
    rows = ["| method | path | what it does | answers |", "|---|---|---|---|"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            summary = operation.get("summary") or ""
            description = (operation.get("description") or "").strip().split("\n\n")[0]
            answers = ", ".join(sorted(operation.get("responses", {})))
            rows.append(f"| {method.upper()} | `{path}` | {_cell(description or summary)} | {answers} |")
    return "\n".join(rows)


def readme() -> str:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return text.replace("](docs/)", "](index.md)").replace("](docs/", "](")


GENERATORS = {
    "readme": readme,
    "settings": settings_table,
    "metrics": metrics_table,
    "model-config": model_config_table,
    "http-api": http_api_table,
}
