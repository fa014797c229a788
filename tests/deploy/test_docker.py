"""The Dockerfiles install exactly the pinned stack and run as the README says.

No Docker engine here: the files are read and checked, not built.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / name).read_text())
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def exposed(steps: list[tuple[str, str]]) -> set[str]:
    """The ports of every EXPOSE, without a /tcp suffix."""
    return {p.split("/")[0] for k, args in steps if k == "EXPOSE" for p in args.split()}


def env_ports(steps: list[tuple[str, str]]) -> dict[str, str]:
    """JITSERVE_PORT and JITSERVE_GRPC_PORT as the ENV lines set them."""
    env = " ".join(args for k, args in steps if k == "ENV")
    return dict(re.findall(r"\b(JITSERVE_(?:GRPC_)?PORT)=(\S+)", env))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_installs_only_what_pyproject_pins(name):
    runs = [args for keyword, args in instructions(name) if keyword == "RUN"]
    installs = [cmd for run in runs for cmd in run.split("&&") if re.search(r"\bpip install\b", cmd)]
    assert installs, f"{name} installs nothing with pip"
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    for command in installs:
        # No second, drifting list of versions: nothing pinned inline ...
        assert not re.search(r"[A-Za-z0-9_.-]+(==|>=|~=)[0-9]", command), command
        # ... only the project itself (with its extras) or a pin read from pyproject.toml.
        targets = re.findall(r'"(\.(?:\[[a-z,]+\])?)"|\s(\.)(?:\s|$)', command)
        reads_pyproject = "pyproject.toml" in command
        assert targets or reads_pyproject, command
        for extra in re.findall(r"\.\[([a-z,]+)\]", command):
            assert set(extra.split(",")) <= extras, f"{name}: unknown extra {extra}"


def test_cuda_image_swaps_in_the_pinned_gpu_runtime():
    (pin,) = PYPROJECT["project"]["optional-dependencies"]["cuda"]
    assert pin.startswith("onnxruntime-gpu==")
    cpu_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("onnxruntime=="))
    assert pin.split("==")[1] == cpu_pin.split("==")[1], "GPU and CPU onnxruntime must be the same release"
    text = (REPO / "Dockerfile.cuda").read_text()
    assert "uninstall" in text and "onnxruntime" in text
    # TVM's CUDA runtime links libcudart.so.13: the base image must be CUDA 13.
    assert re.search(r"^FROM nvidia/cuda:13\.", text, re.M)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_non_root_with_data_volume_and_healthcheck(name):
    steps = instructions(name)
    keywords = [k for k, _ in steps]
    users = [args for k, args in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the server must not run as root"
    assert keywords.index("USER") < keywords.index("CMD")
    assert ("VOLUME", "/data") in steps
    env = " ".join(args for k, args in steps if k == "ENV")
    assert "JITSERVE_DATA_DIR=/data" in env
    port = re.search(r"\bJITSERVE_PORT=(\d+)", env).group(1)
    assert port in exposed(steps)
    healthcheck = next(args for k, args in steps if k == "HEALTHCHECK")
    assert f"127.0.0.1:{port}/healthz" in healthcheck
    assert next(args for k, args in steps if k == "CMD") == '["python", "-m", "server"]'


@pytest.mark.parametrize("name", DOCKERFILES)
def test_exposes_http_and_grpc_ports_it_sets(name):
    steps = instructions(name)
    ports = env_ports(steps)
    assert ports == {"JITSERVE_PORT": "8000", "JITSERVE_GRPC_PORT": "8001"}, f"{name}: {ports}"
    # Exactly the two ports the server listens on: gRPC beside HTTP, nothing stale.
    assert exposed(steps) == set(ports.values()), f"{name} exposes {sorted(exposed(steps))}"


def test_compose_publishes_the_http_and_grpc_ports_it_sets():
    service = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["jitserve"]
    env = service["environment"]
    ports = {name: str(env[name]) for name in ("JITSERVE_PORT", "JITSERVE_GRPC_PORT")}
    assert ports == {"JITSERVE_PORT": "8000", "JITSERVE_GRPC_PORT": "8001"}
    assert env["JITSERVE_HOST"] == "0.0.0.0"  # the published ports reach the server only off loopback
    # Each port published on the same host port, both as "HOST:CONTAINER" strings.
    published = {str(p).rpartition(":")[2].split("/")[0]: str(p) for p in service["ports"]}
    for port in ports.values():
        assert published.get(port) == f"{port}:{port}", f"compose does not publish {port}: {service['ports']}"
    # The image's own EXPOSE names the same ports.
    assert set(ports.values()) <= exposed(instructions(service["build"]["dockerfile"]))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned_and_python_matches(name):
    for keyword, args in instructions(name):
        if keyword == "FROM" or (keyword == "COPY" and "--from=" in args):
            image = args.split("--from=")[1].split()[0] if "--from=" in args else args.split()[0]
            assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image}"
    requires = PYPROJECT["project"]["requires-python"]
    assert "3.11" in (REPO / name).read_text() and ">=3.11" in requires


def test_aot_step_uses_the_compiler_cli_into_the_data_volume():
    text = (REPO / "Dockerfile").read_text()
    assert 'python -m compiler compile "$AOT_MODEL" $AOT_SHAPES --store /data/kernels' in text
    assert (REPO / "aot").is_dir()
