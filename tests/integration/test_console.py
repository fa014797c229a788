"""The console (``GET /``) and the API docs, in headless Chromium against a real server: a model uploaded
through the form, a bucket seen compiling to ``ready`` without a reload, a prediction from the predict
form, labels on every control, rendering 50 models of 20 buckets timed, and no request leaving the server."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests import synthetic
from tests.integration.serverproc import ServerProcess

ENCODER = {"layers": 1, "hidden": 64, "heads": 4, "seq": 16}
CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}}}
SCREENSHOT = os.environ.get("JITSERVE_SCREENSHOT_DIR")
"""Where the test saves its screenshot for the README (a temporary folder without it)."""


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is needed: apt-get install chromium (.ci/system-packages installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=path, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        try:
            yield launched
        finally:
            launched.close()


def _fake_state(models: int, buckets: int) -> dict:
    """What ``GET /models`` and ``GET /server`` answer, for ``models`` models of ``buckets`` buckets."""
    bucket = {"state": "ready", "reason": "measured faster", "engine": "tvm", "latency_ms": {"tvm": 1.2,
              "onnxruntime": 1.9}, "hits": 10, "traffic": 0.5, "padded_error": {"tvm": 1e-6},
              "compile_seconds": 3.2, "tuning": None}  # fmt: skip
    model = {"version": 1, "signature": {"inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 16]}]},
             "axes": {"batch": {"policy": {"kind": "pow2", "min": 1, "max": 64}, "effective_policy": "pow2",
                                "padding_safety": {"safe": True, "reason": "outputs match"}}},
             "dynamic_batching": None,
             "compile_admission": {"compiled_buckets": buckets, "max_compiled_buckets": 64}}  # fmt: skip
    server = {"ready": True, "waiting": [], "jit": True, "tuning": True, "routing": "measured",
              "compile_queue": {"queued": 0, "running": 0, "queue_size": 64, "workers": 1},
              "memory": {"server_bytes": 2**28, "children_bytes": 0, "weights_bytes": 2**20, "limit_bytes": None},
              "kernel_cache": {"entries": 5, "max_entries": 64, "bytes": 2**20, "max_bytes": 2**30},
              "store_check": {"kernels": {"ok": 3, "damaged": 0}, "models": {"ok": 50, "damaged": 0}}}  # fmt: skip
    return {
        "models": [
            model | {"name": f"m{i}", "buckets": [bucket | {"bucket": f"x={2**j}x16"} for j in range(buckets)]}
            for i in range(models)
        ],
        "server": server,
    }


def test_the_console_shows_a_bucket_compile_to_ready_without_a_reload(browser, tmp_path):
    process = ServerProcess(tmp_path / "data", tuning_enabled=False, routing="compiled").start()
    outside: list[str] = []
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        local = (process.url, f"blob:{process.url}", "data:")
        page.on("request", lambda r: None if r.url.startswith(local) else outside.append(r.url))
        page.goto(process.url + "/")
        page.wait_for_selector("#status h2")  # rendered from the JSON
        page.evaluate("window.__loaded = 'once'")  # gone if the page reloads

        model_file = tmp_path / "enc.onnx"
        model_file.write_bytes(synthetic.bert_encoder_model(**ENCODER))
        page.fill("#upload-name", "enc")
        page.set_input_files("#upload-file", str(model_file))
        page.fill("#upload-config", json.dumps(CONFIG))
        page.click("#upload-form button")
        page.wait_for_function("document.getElementById('upload-result').textContent.startsWith('201')")
        page.wait_for_selector("section[data-model='enc']")

        # One request makes the bucket compile (JITSERVE_COMPILE_MIN_HITS=1 in these tests).
        x = np.zeros((2, 16, 64), np.float32).tolist()
        started = time.monotonic()
        httpx.post(process.url + "/models/enc/predict", json={"inputs": {"x": x}}, timeout=60).raise_for_status()
        page.wait_for_selector("section[data-model='enc'] td.state-ready", timeout=180_000)
        seen = time.monotonic() - started
        described = httpx.get(process.url + "/models/enc").json()["buckets"]
        assert [b["state"] for b in described] == ["ready"]
        assert "store check: kernels" in page.inner_text("#status")  # what the server found sound at start
        assert page.evaluate("window.__loaded") == "once"  # updated in place
        row = page.locator("section[data-model='enc'] tbody tr").first
        assert "x=2x16x64" in row.inner_text() and row.locator("a", has_text="explain").count() == 1
        print(f"bucket ready on the page {seen:.1f} s after its first request")

        page.select_option("#predict-model", "enc")
        page.fill("#predict-inputs", json.dumps({"x": np.zeros((1, 16, 64)).tolist()}))
        page.click("#predict-form button")
        page.wait_for_function("document.getElementById('predict-result').textContent.startsWith('200')")
        assert '"outputs"' in page.inner_text("#predict-result")

        # A decoder with its key/value cache: its generation state on its section.
        decoder = synthetic.kv_cache_decoder_model()
        httpx.put(process.url + "/models/gpt", content=decoder, timeout=60).raise_for_status()
        httpx.post(process.url + "/v2/models/gpt/generate", json={"input_ids": [1, 2], "parameters": {"max_tokens": 3}},
                   timeout=60).raise_for_status()  # fmt: skip
        line = page.locator("section[data-model='gpt'] .generation")
        line.wait_for(timeout=30_000)
        assert "a decoder of 2 layers, 4 heads, 64 positions; sequences running 0, waiting 0" in line.inner_text()

        # Every control labelled and reachable from the keyboard.
        unlabelled = page.evaluate(
            "Array.from(document.querySelectorAll('input, select, textarea'))"
            ".filter(e => !e.labels || e.labels.length === 0).map(e => e.id)"
        )
        assert unlabelled == []
        assert page.evaluate("Array.from(document.querySelectorAll('input, select, textarea, button'))"
                             ".every(e => e.tabIndex >= 0)")  # fmt: skip

        directory = Path(SCREENSHOT) if SCREENSHOT else tmp_path
        directory.mkdir(parents=True, exist_ok=True)
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(directory / "console.png"))

        # 50 models of 20 buckets: rendered in the browser, timed there.
        took = page.evaluate(
            "state => { const t = performance.now(); window.jitserveConsole.render(state);"
            " return performance.now() - t; }",
            _fake_state(50, 20),
        )
        assert page.locator("#status tbody tr").count() == 1000
        print(f"50 models x 20 buckets rendered in {took:.1f} ms")
        assert took < 200

        for path, ready in (("/docs", ".swagger-ui .info"), ("/redoc", "text=jitserve")):
            page.goto(process.url + path)
            page.wait_for_selector(ready, timeout=30_000)
    finally:
        process.stop()
    assert outside == [], outside
