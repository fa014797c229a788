"""The documentation site builds strictly (no broken link or anchor, every page in the navigation), and
its reference pages are generated from the code: every setting, metric, config field and route."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from server.app import create_app
from server.runtime.models.records import ModelConfig
from server.runtime.observability.metrics import Metrics
from server.settings import Settings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_the_site_builds_strictly_with_the_readme_as_its_home(site):
    home = (site / "index.html").read_text()
    assert "make run" in home and "make test" in home
    assert 'href="quickstart/"' in home  # the README's docs/ links, made relative to the site


def test_the_reference_pages_hold_every_setting_metric_config_field_and_route(site):
    settings = _page(site, "reference/settings")
    for name in Settings.model_fields:
        assert f"JITSERVE_{name.upper()}" in settings and f"--{name.replace('_', '-')}" in settings, name
    metrics = _page(site, "reference/metrics")
    for collector in Metrics().registry._collector_to_names:
        assert collector._name in metrics, collector._name
    config = _page(site, "reference/model-config")
    for name in ModelConfig.model_fields:
        assert f"<code>{name}</code>" in config, name
    api = _page(site, "reference/http-api")
    with tempfile.TemporaryDirectory() as data_dir:
        paths = create_app(Settings(data_dir=data_dir, demo_model=False, grpc_port=0)).openapi()["paths"]
    for path in paths:
        assert f"<code>{path}</code>" in api, path
