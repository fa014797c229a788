"""Hostile input against a real server: a corpus of malformed models, then over 2,000 hand-made
malformed requests (tests/fuzz_cases.py). No answer is a 5xx, every refusal is ``{"error": ...}``,
the server stays up and keeps serving right answers, and nothing broken is stored."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests import fuzz_cases, malformed, synthetic
from tests.integration.serverproc import ServerProcess

CLIENTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    # No compiles: this is about the front door, and compile children have their own crash tests.
    process = ServerProcess(tmp_path_factory.mktemp("hostile") / "data", compile_workers=0).start()
    with process.client() as client:
        assert client.put(f"/models/{fuzz_cases.MODEL}", content=synthetic.add_model()).status_code == 201
    yield process
    process.stop()


def refusal_problem(response: httpx.Response) -> str | None:
    """What is wrong with an answer to hostile input, or None."""
    if response.status_code >= 500:
        return f"{response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            return f"{response.status_code} not JSON: {response.text[:200]!r}"
        if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) and body["error"]):
            return f"{response.status_code} not an error body: {body!r:.200}"
    return None


def assert_still_serving(server: ServerProcess) -> None:
    assert server.process.poll() is None, server.log()[-3000:]
    with server.client() as client:
        response = client.post(f"/models/{fuzz_cases.MODEL}/predict", json={"inputs": {"x": fuzz_cases.VALID_ROWS}})
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(response.json()["outputs"]["y"], np.asarray(fuzz_cases.VALID_ROWS) * 2)


def stored_models(server: ServerProcess) -> set[str]:
    return {p.name for p in (server.data_dir / "models").iterdir() if p.is_dir() and not p.name.startswith(".")}


def test_every_malformed_model_is_refused_with_a_4xx_and_nothing_is_stored(server):
    before = stored_models(server)
    answers = {}
    with server.client() as client:
        for name, data in malformed.corpus().items():
            response = client.put("/models/broken", content=data)
            answers[name] = (response.status_code, response.text[:200])
            assert refusal_problem(response) is None, (name, answers[name])
    refused = {name for name, (status, _) in answers.items() if status in (400, 413, 422)}
    assert refused == set(answers), {name: answers[name] for name in set(answers) - refused}
    assert len(answers) >= 30
    assert stored_models(server) == before
    assert not any((server.data_dir / "uploads").iterdir()) if (server.data_dir / "uploads").exists() else True
    assert_still_serving(server)


def test_two_thousand_hand_made_malformed_requests_get_no_5xx(server):
    cases = fuzz_cases.all_cases(seed=2026, predicts=900, v2=700, names=250, uploads=250)
    assert len(cases) >= 2000

    def send(case: fuzz_cases.Case) -> tuple[fuzz_cases.Case, int, str | None]:
        with server.client() as client:  # a fresh connection per case
            try:
                response = client.request(
                    case.method, case.path, content=case.body or None, headers=case.headers,
                    files=case.files, data=case.data,
                )  # fmt: skip
            except httpx.HTTPError as exc:
                return case, 0, f"no answer: {exc!r}"
        return case, response.status_code, refusal_problem(response)

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(send, cases))
    problems = [f"{case.describe()} -> {problem}" for case, _, problem in results if problem]
    assert not problems, f"{len(problems)} bad answers:\n" + "\n".join(problems[:20])
    statuses = {status for _, status, _ in results}
    assert {200, 400, 404} <= statuses  # the cases reach the models, not only the front door's checks
    assert "unhandled error" not in server.log()
    assert_still_serving(server)
