"""Observability: the Prometheus config, the Grafana provisioning and dashboard and
docker-compose.yml agree with each other, and every dashboard query returns data
from a real Prometheus scraping a real server after a short load.

Prometheus and promtool come from Debian's ``prometheus`` package; without them
the tests that need them are skipped, or fail when ``CI`` is set.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import yaml
from tritonclient.utils import InferenceServerException

from compiler.models.demo import demo_model_bytes
from server.runtime.observability.metrics import Metrics
from tests import synthetic
from tests.integration.serverproc import (
    REPO,
    ServerProcess,
    free_port,
    metric_value,
    new_graph_variant,
    stop_process,
    variant,
    wait_until,
)
from tests.integration.test_serving import upload, wait_ready

PROMETHEUS_CONFIG = REPO / "configs" / "prometheus" / "prometheus.yml"
PROVISIONING = REPO / "configs" / "grafana" / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "prometheus.yml"
PROVIDERS = PROVISIONING / "dashboards" / "jitserve.yml"
DASHBOARDS = REPO / "configs" / "grafana" / "dashboards"
DASHBOARD = DASHBOARDS / "jitserve.json"
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"

DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
# Grafana's variables are not PromQL: each becomes what Grafana would send.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "1m", "__range": "5m", "model": ".*"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# Background tuning that finishes in under a minute, once: see tests/integration/test_tuning.py.
SERVER_SETTINGS = {
    "routing": "compiled",  # kernel-served requests: cache lookups and padding are only counted for those
    "kernel_cache_entries": 2,  # evictions, misses and reloads
    "tune_min_hits": 5,
    "tuning_interval_seconds": 0.5,
    "tune_trials_per_bucket": 2,
    "tune_trials_per_task": 1,
    "tuning_total_seconds": 1,  # one tuning run, then the budget is spent
    "routing_runs": 3,
    "openvino": True,  # as users run it: OpenVINO measured beside TVM (and its compiles counted on their own)
}
CLF_CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}}, "warm_buckets": [{"x": [1, 4]}]}
CLF_BUCKETS = {1: "x=1x4", 3: "x=4x4", 5: "x=8x4"}
BATCHED_CONFIG = {
    "axes": {"batch": {"kind": "pow2", "min": 1, "max": 8}},
    "dynamic_batching": {"max_batch_size": 8, "max_queue_delay_us": 1000},
}


# -- the dashboard ---------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def walk_panels(panels: list[dict]):
    """Every panel, rows' nested panels (collapsed rows hold theirs) included."""
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels") or [])


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every target's expr and every query variable."""
    queries = []
    for panel in walk_panels(dashboard["panels"]):
        for target in panel.get("targets") or []:
            queries.append((f"{panel['title']!r} {target.get('refId')}", target["expr"]))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        definition = variable.get("definition") or variable["query"]["query"]
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
        assert found, f"variable {variable['name']}: unsupported query {definition!r}"
        queries.append((f"variable ${variable['name']}", f"count by ({found[2]}) ({found[1]})"))
    return queries


def to_promql(expr: str) -> str:
    def substitute(match: re.Match) -> str:
        name = match[1] or match[2]
        assert name in GRAFANA_VARIABLES, f"unknown Grafana variable ${name} in {expr!r}"
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", substitute, expr)


# -- tools from Debian's prometheus package ----------------------------------------


def find_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
    if path:
        return path
    message = f"{name} not found: install Debian's prometheus package (apt-get install prometheus)"
    pytest.fail(message)  # a green run means every test ran: never a silent skip


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return find_tool("prometheus")


@pytest.fixture(scope="module")
def promtool_bin() -> str:
    return find_tool("promtool")


class PrometheusProcess:
    """A Prometheus on a free loopback port scraping one jitserve every second."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": "jitserve", "static_configs": [{"targets": [target]}]}],
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusProcess:
        log = open(self.log_path, "a")  # noqa: SIM115 - lives as long as the process
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log()}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, interval=0.2, what=f"prometheus ready\n{self.log()}")

    def query(self, promql: str) -> dict:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10)
        return response.json()

    def scalar(self, promql: str) -> float | None:
        result = self.query(promql).get("data", {}).get("result") or []
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        stop_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""


# -- load ---------------------------------------------------------------------------


def ask(client, model: str, n: int, expect: int = 200) -> dict:
    x = np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)
    response = client.post(f"/models/{model}/predict", json={"inputs": {"x": x.tolist()}})
    assert response.status_code == expect, response.text
    return response.json()


def ask_width(client, width: int) -> dict:
    """A request to ``widths``, whose W axis padding would change: served by its dynamic tier."""
    x = np.linspace(-1, 1, 8 * width, dtype=np.float32).reshape(1, 8, width)
    response = client.post("/models/widths/predict", json={"inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    assert "@" in response.json()["bucket"], response.json()  # a symbolic bucket
    return response.json()


def errors(client) -> None:
    assert client.post("/models/clf/predict", json={"inputs": {"y": [[1.0] * 4]}}).status_code == 400
    assert client.post("/predict", json={"model": "nope", "inputs": {"x": [[1.0] * 4]}}).status_code == 404


def grpc_calls(target: str) -> None:
    """Predictions over gRPC, one refused: the gRPC panel's series and the request panels' grpc protocol."""
    with triton.InferenceServerClient(target) as client:
        assert client.is_server_ready()
        for dtype, datatype in ((np.float32, "FP32"), (np.float64, "FP64")):
            tensor = triton.InferInput("x", [2, 4], datatype)
            tensor.set_data_from_numpy(np.ones((2, 4), dtype))
            try:
                client.infer("mlp", [tensor])
            except InferenceServerException as error:
                assert datatype == "FP64" and error.status() == "StatusCode.INVALID_ARGUMENT", error


def tuned(client) -> bool:
    return metric_value(client.get("/metrics").text, "jitserve_tuning_seconds_total") > 0


def generate(client) -> None:
    """Two sequences decoded together, one token each step."""
    with ThreadPoolExecutor(2) as pool:
        body = {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 8}}
        for answer in pool.map(lambda _: client.post("/v2/models/gpt/generate", json=body), range(2)):
            assert answer.status_code == 200, answer.text


def generate_load(client) -> None:
    """Compiles, a recompile, cache hits, misses, reloads and evictions, padding, 400s and 404s, one tuning run,
    batched runs."""
    # The tuned bucket first: tuning takes the longest and runs while the rest goes on.
    assert upload(client, "mlp", demo_model_bytes()).status_code == 201
    assert ask(client, "mlp", 8)["engine"] == "onnxruntime"  # compiled meanwhile
    wait_ready(client, "mlp", "x=8x4")
    for _ in range(5):
        assert ask(client, "mlp", 6)["engine"] == "tvm"  # padded 6 -> 8

    clf = demo_model_bytes()
    assert upload(client, "clf", variant(clf, "v1"), CLF_CONFIG).status_code == 201
    wait_ready(client, "clf", CLF_BUCKETS[1])
    for n, label in CLF_BUCKETS.items():
        ask(client, "clf", n)
        wait_ready(client, "clf", label)
        assert ask(client, "clf", n)["engine"] == "tvm"
    for n in CLF_BUCKETS:  # three clf kernels and mlp's through a cache of two
        ask(client, "clf", n)
    errors(client)
    assert upload(client, "batched", variant(clf, "batched"), BATCHED_CONFIG).status_code == 201
    ask(client, "batched", 2)
    assert upload(client, "widths", synthetic.mean_mix_model(weight=1.0)).status_code == 201
    for width in (20, 30):
        ask_width(client, width)

    replaced = upload(client, "clf", new_graph_variant(clf, "v2"), CLF_CONFIG, replace="true")
    assert replaced.status_code == 201 and replaced.json()["version"] == 2, replaced.text
    ask(client, "clf", 1)
    wait_ready(client, "clf", CLF_BUCKETS[1])  # a recompile: new_model_version

    assert upload(client, "gpt", synthetic.kv_cache_decoder_model()).status_code == 201
    generate(client)  # its series scraped before the last minute's generates: the rates have an increase

    wait_until(lambda: tuned(client), timeout=300, interval=1, what="a tuning run")
    # Within the last minute of every rate: each model, engine, bucket and error again.
    for _ in range(2):
        generate(client)
        ask(client, "mlp", 6)
        for n in CLF_BUCKETS:
            ask(client, "clf", n)
        ask(client, "batched", 3)
        ask_width(client, 25)
    errors(client)
    generate(client)  # last: the generation rates' increase is the newest, well within the queries' minute


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path, prometheus_bin):
    queries = dashboard_queries(load_dashboard())
    server = ServerProcess(tmp_path / "data", grpc_port=free_port(), **SERVER_SETTINGS)
    (tmp_path / "prometheus").mkdir()
    prometheus = PrometheusProcess(prometheus_bin, tmp_path / "prometheus", f"127.0.0.1:{server.port}")
    try:
        prometheus.start()
        server.start()
        prometheus.wait_ready()
        with server.client() as client:
            generate_load(client)
            grpc_calls(f"127.0.0.1:{server.settings['grpc_port']}")
            served = metric_value(client.get("/metrics").text, "jitserve_requests_total")

        # Scraped after the load, then twice more: every rate has two samples of every series.
        wait_until(
            lambda: prometheus.scalar("sum(jitserve_requests_total)") == served,
            timeout=30,
            what=f"prometheus scraping the load\n{prometheus.log()}",
        )
        scraped = prometheus.scalar('timestamp(up{job="jitserve"})')
        wait_until(lambda: prometheus.scalar('timestamp(up{job="jitserve"})') >= scraped + 2, timeout=30)
        assert prometheus.scalar('up{job="jitserve"}') == 1

        failures = []
        for where, expr in queries:
            promql = to_promql(expr)
            answer = prometheus.query(promql)
            result = answer.get("data", {}).get("result") or []
            values = [float(sample["value"][1]) for sample in result]
            finite = [v for v in values if math.isfinite(v)]
            print(f"{where}: {len(result)} series, {promql}")
            if answer.get("status") != "success":
                failures.append(f"{where}: {answer.get('errorType')}: {answer.get('error')}\n    {promql}")
            elif not finite:
                failures.append(f"{where}: no data ({len(result)} series, values {values})\n    {promql}")
        assert not failures, "dashboard queries without data:\n" + "\n".join(failures)
    finally:
        server.stop()
        prometheus.stop()


def test_promtool_accepts_the_prometheus_config(promtool_bin):
    checked = subprocess.run(
        [promtool_bin, "check", "config", str(PROMETHEUS_CONFIG)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- static checks ------------------------------------------------------------------


def test_dashboard_is_well_formed_and_shows_every_metric():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "jitserve"
    assert dashboard["schemaVersion"] >= 36
    panels = list(walk_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no queries"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]

    promql = "\n".join(expr for _, expr in dashboard_queries(dashboard))
    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    exported = {family.name + suffix[family.type] for family in Metrics().registry.collect()}
    missing = {name for name in exported if not re.search(rf"\b{name}\b", promql)}
    assert not missing, f"metrics in compiler/metrics.py that no dashboard panel shows: {sorted(missing)}"


def compose_environment(service: dict) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) if "=" in item else (item, "") for item in environment)
    return {key: str(value) for key, value in environment.items()}


def command_flag(service: dict, flag: str, default: str) -> str:
    command = service.get("command") or []
    if isinstance(command, str):
        command = shlex.split(command)
    for i, arg in enumerate(command):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
    return default


def is_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def mounts(service: dict) -> dict[str, str]:
    """Container path -> source: a resolved host path for binds, the name for named volumes."""
    found = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            if len(parts) < 2:  # an anonymous volume
                continue
            source, target = parts[0], parts[1]
        else:
            source, target = volume.get("source"), volume["target"]
            if not source:
                continue
        found[target.rstrip("/")] = str((COMPOSE.parent / source).resolve()) if is_path(source) else source
    return found


def dockerfile_env(name: str) -> str | None:
    if not DOCKERFILE.exists():
        return None
    found = re.search(rf"^ENV\s.*\b{name}=(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    return found[1] if found else None


def test_compose_prometheus_and_grafana_agree():
    assert COMPOSE.exists(), "docker-compose.yml (jitserve, prometheus, grafana) is missing"
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"jitserve", "prometheus", "grafana"} <= set(services), sorted(services)
    jitserve, prometheus, grafana = services["jitserve"], services["prometheus"], services["grafana"]

    # jitserve listens where Prometheus scrapes, on an address another container reaches.
    env = compose_environment(jitserve)
    port = int(env.get("JITSERVE_PORT", 8000))
    host = env.get("JITSERVE_HOST") or dockerfile_env("JITSERVE_HOST") or "127.0.0.1"
    assert host not in LOOPBACK, "jitserve binds loopback: Prometheus in its own container cannot scrape it"
    assert "JITSERVE_ADMIN_TOKEN" in env or jitserve.get("env_file"), "a non-loopback jitserve needs a token"
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert len(scrape) == 1, scrape
    assert scrape[0].get("metrics_path", "/metrics") == "/metrics"
    assert scrape[0].get("scheme", "http") == "http"
    targets = [target for group in scrape[0]["static_configs"] for target in group["targets"]]
    assert targets == [f"jitserve:{port}"], f"prometheus scrapes {targets}; jitserve listens on jitserve:{port}"

    # Prometheus reads the mounted config; its data volume is declared.
    prometheus_mounts = mounts(prometheus)
    config_path = command_flag(prometheus, "--config.file", "/etc/prometheus/prometheus.yml")
    assert prometheus_mounts.get(config_path) == str(PROMETHEUS_CONFIG), (config_path, prometheus_mounts)
    prometheus_port = int(command_flag(prometheus, "--web.listen-address", "0.0.0.0:9090").rsplit(":", 1)[1])

    # Grafana: provisioning and dashboards mounted where the provider looks.
    grafana_mounts = mounts(grafana)
    assert grafana_mounts.get("/etc/grafana/provisioning") == str(PROVISIONING), grafana_mounts
    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert [p["type"] for p in providers] == ["file"], providers
    provider_path = providers[0]["options"]["path"].rstrip("/")
    assert grafana_mounts.get(provider_path) == str(DASHBOARDS), (provider_path, grafana_mounts)
    home = compose_environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home.startswith(provider_path + "/"), home
        assert (DASHBOARDS / home[len(provider_path) + 1 :]).is_file(), home

    # The datasource points at the prometheus service; every panel uses it by uid.
    datasources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert len(datasources) == 1, datasources
    datasource = datasources[0]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    url = urlsplit(datasource["url"])
    assert (url.scheme, url.hostname, url.port) == ("http", "prometheus", prometheus_port), datasource["url"]
    uid = datasource["uid"]
    assert uid == DATASOURCE["uid"]
    dashboard = load_dashboard()
    used = [
        (panel["title"], item["datasource"])
        for panel in walk_panels(dashboard["panels"])
        if panel["type"] != "row"
        for item in [panel, *panel.get("targets", [])]
    ]
    used += [(f"${v['name']}", v["datasource"]) for v in dashboard.get("templating", {}).get("list", [])]
    wrong = [(where, ds) for where, ds in used if ds != {"type": "prometheus", "uid": uid}]
    assert not wrong, f"panels not on datasource uid {uid!r}: {wrong}"

    # Every named volume a service mounts is declared.
    declared = set(compose.get("volumes") or {})
    named = {
        source
        for service in services.values()
        for source in mounts(service).values()
        if not source.startswith("/")  # resolved bind paths are absolute
    }
    assert named <= declared, f"named volumes not declared at the top level: {sorted(named - declared)}"
