"""Explain what the JIT did, against a real server: a compiled bucket's bundle over REST (JSON, report page,
IR, one kernel's function, traces), a profile made on demand in a child, the compile history telling what a
recompile changed, and the report page opened in headless Chromium with no request leaving the server."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests import synthetic
from tests.integration.serverproc import ServerProcess, new_graph_variant
from tests.integration.test_serving import upload, wait_ready

TOKEN = "explain-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ENCODER = {"layers": 1, "hidden": 64, "heads": 4, "seq": 16}
CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}}, "warm_buckets": [{"x": [2, 16, 64]}]}
LABEL = "x=2x16x64"
BASE = f"/models/enc/buckets/{LABEL}"
SCREENSHOT = os.environ.get("JITSERVE_SCREENSHOT_DIR")
"""Where the browser test saves its screenshot for the README (a temporary folder without it)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with one compiled encoder bucket, and its model's bytes."""
    data_dir = tmp_path_factory.mktemp("explain") / "data"
    process = ServerProcess(data_dir, admin_token=TOKEN, tuning_enabled=False, routing="compiled").start()
    data = synthetic.bert_encoder_model(**ENCODER)
    try:
        with process.client() as http:
            http.headers.update(AUTH)
            assert upload(http, "enc", data, CONFIG).status_code == 201
            wait_ready(http, "enc", LABEL)
        yield process, data
    finally:
        process.stop()


def test_the_bundle_traces_every_kernel_to_its_nodes(served):
    process, _ = served
    with process.client() as http:
        body = http.get(f"{BASE}/explain").json()
        report = body["explain"]
        assert body["engine"] == "tvm" and body["kernel"]
        assert report["kernels"] and all(kernel["nodes"] for kernel in report["kernels"])
        coverage = report["compute_coverage"]
        assert coverage["compute_nodes"] > 0 and coverage["in_a_kernel"] == coverage["compute_nodes"]
        [first] = body["history"]
        assert first["reason"] == "first_compile" and first["changed"] == [] and first["key"] == body["kernel"]
        assert first["compile_seconds"] > 0

        stages = list(report["ir"])
        assert stages[0] == "import" and "legalize" in stages
        assert "def main(" in http.get(f"{BASE}/explain/ir/import").text
        kernel = report["kernels"][0]["name"]
        function = http.get(f"{BASE}/explain/ir/{stages[-1]}", params={"kernel": kernel}).text
        assert f"def {kernel}(" in function and "def main(" not in function

        page = http.get(f"{BASE}/explain.html")
        assert page.headers["content-type"].startswith("text/html") and "kernel-table" in page.text
        assert kernel in page.text and "first_compile" in page.text


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/models/enc/buckets/x=4x16x64/explain", 404, "no bucket"),
        ("/models/none/buckets/x=2x16x64/explain", 404, "none"),
        (f"{BASE}/explain/ir/nosuchstage", 404, "no stage"),
        (f"{BASE}/explain/ir/lower?kernel=nosuchkernel", 404, "no function"),
        (f"{BASE}/explain/trace?engine=gpu", 400, "engine"),
    ],
)
def test_what_is_not_there_is_a_clear_error(served, path, status, words):
    process, _ = served
    with process.client() as http:
        response = http.get(path)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]


def test_a_profile_on_demand_joins_each_kernel_to_onnx_runtimes_nodes(served):
    process, _ = served
    with process.client() as http:
        assert http.post(f"{BASE}/explain/profile").status_code == 401
        bad = http.post(f"{BASE}/explain/profile", json={"runs": 0}, headers=AUTH)
        assert bad.status_code == 400 and "invalid profile request" in bad.json()["error"]
        response = http.post(f"{BASE}/explain/profile", json={"runs": 5}, headers=AUTH, timeout=180)
        assert response.status_code == 200, response.text
        profile = response.json()
        rows = profile["kernels"]
        # Each kernel the VM called has its time (one it turned into a view, a reshape, has none).
        assert rows and all((row["tvm_ms"] is not None) == (row["calls"] >= 1) for row in rows)
        # Each matmul kernel has ONNX Runtime's time on the same nodes beside it.
        matmuls = [row for row in rows if "matmul" in row["kernel"]]
        assert matmuls and all(row["tvm_ms"] and row["ort_ms"] for row in matmuls), matmuls
        assert profile["tvm"]["run_ms"] > 0 and profile["onnxruntime"]["run_ms"] > 0
        assert 0.3 < profile["accounted"] < 3  # the calls' times are a run's, not off by a unit
        for engine in ("tvm", "onnxruntime"):
            trace = http.get(f"{BASE}/explain/trace", params={"engine": engine}).json()
            events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
            assert events and all(e["dur"] >= 0 for e in events)
        tvm_events = http.get(f"{BASE}/explain/trace").json()["traceEvents"]
        assert any(e.get("args", {}).get("onnx_nodes") for e in tvm_events)
        assert http.get(f"{BASE}/explain").json()["profile"]["kernels"] == rows  # kept in the bundle


def test_the_report_page_renders_in_chromium_without_a_request_outside_the_server(served, tmp_path):
    from playwright.sync_api import sync_playwright

    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser_path, "Chromium is needed: apt-get install chromium (the test setup script installs it)"
    process, _ = served
    outside = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=browser_path, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("request", lambda r: None if r.url.startswith(process.url) else outside.append(r.url))
            page.goto(f"{process.url}{BASE}/explain.html")
            rows = page.locator("#kernel-table tbody tr")
            assert rows.count() >= 3
            assert page.locator("h2", has_text="Kernels").is_visible()
            header = page.locator("#kernel-table th", has_text="TVM ms")
            header.focus()
            page.keyboard.press("Enter")  # sortable from the keyboard
            directory = Path(SCREENSHOT) if SCREENSHOT else tmp_path
            directory.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(directory / "explain-report.png"), full_page=False)
            with page.expect_navigation():
                page.locator("a", has_text="legalize").first.click()
            assert "def main(" in page.content()
        finally:
            browser.close()
    assert outside == []


def test_a_recompile_names_what_changed_in_its_key(served):
    process, data = served
    with process.client() as http:
        http.headers.update(AUTH)
        replaced = upload(http, "enc", new_graph_variant(data, "explain"), CONFIG, replace="true")
        assert replaced.status_code == 201, replaced.text
        wait_ready(http, "enc", LABEL)
        history = http.get(f"{BASE}/explain").json()["history"]
    newest, before = history[0], history[1]
    assert newest["reason"] == "new_model_version"
    assert set(newest["changed"]) == {"model version", "graph"}
    assert newest["key"] != before["key"]
