"""Locust scenario: steady shapes plus a long tail of distinct shapes.

Standalone against a running server that has the model uploaded as
``token_mlp`` (``loadtest/run.py`` does both and writes the report):

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 3m --host http://127.0.0.1:8000
"""

from __future__ import annotations

import random

import numpy as np
import orjson
from locust import FastHttpUser, between, task

try:
    from scenario import STEADY_SHAPES, long_tail_shape, payload
except ImportError:  # imported as loadtest.locustfile
    from loadtest.scenario import STEADY_SHAPES, long_tail_shape, payload

MODEL = "token_mlp"


class JitserveUser(FastHttpUser):
    wait_time = between(0.0, 0.05)

    def on_start(self) -> None:
        self.random = random.Random()
        self.numbers = np.random.default_rng(self.random.randrange(1 << 30))

    def _predict(self, shape: tuple[int, int]) -> None:
        body = orjson.dumps(payload(shape, self.numbers), option=orjson.OPT_SERIALIZE_NUMPY)
        name = f"predict b={shape[0]} s={shape[1]}"
        with self.client.post(
            f"/models/{MODEL}/predict",
            data=body,
            headers={"content-type": "application/json"},
            name=name,
            catch_response=True,
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")

    @task(1)
    def steady(self) -> None:
        self._predict(self.random.choice(STEADY_SHAPES))

    @task(1)
    def long_tail(self) -> None:
        self._predict(long_tail_shape(self.random))
