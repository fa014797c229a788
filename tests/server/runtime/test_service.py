"""The runtime in-process, with a fake compiler and fake kernels: single-flight,
the full queue, route choice and restore, replace and retire in flight."""

from __future__ import annotations

import concurrent.futures
import gc
import weakref

import numpy as np
import pytest

from compiler.errors import (
    CompileCrashedError,
    CompileTimeoutError,
    NotFoundError,
    UnavailableError,
    UnsupportedOperatorError,
)
from compiler.models.demo import DEMO_CONFIG, demo_model_bytes
from compiler.running.engines import OrtEngine
from server.runtime.models.state import BucketState
from tests.integration.serverproc import metric_value
from tests.server.fakes import (
    FakeCompiler,
    FakeKernels,
    SlowEngine,
    admit,
    make_service,
    probed,
    register,
    wait_until,
)

DEMO = demo_model_bytes()
CONFIG = {"axes": {"batch": {"kind": "pow2", "min": 1, "max": 64}}}
REFERENCE = OrtEngine(DEMO)


def rows(n: int) -> list[list[float]]:
    return np.arange(n * 4, dtype=np.float32).reshape(n, 4).tolist()


def expected(n: int) -> np.ndarray:
    return REFERENCE.run({"x": np.asarray(rows(n), dtype=np.float32)})["probs"]


def bucket_state(service, label: str, name: str = "m") -> BucketState | None:
    bucket = service.get(name).buckets.get(label)
    return bucket.state if bucket else None


@pytest.fixture
def compiler():
    compiler = FakeCompiler()
    yield compiler
    compiler.gate.set()  # never leave a worker blocked


def test_one_compile_per_bucket_under_concurrent_requests(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), routing="compiled")
    try:
        register(service, "m", DEMO, CONFIG)
        compiler.gate.clear()
        sizes = [1, 3] * 24  # buckets x=1x4 and x=4x4
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda n: (n, service.predict("m", {"x": rows(n)})), sizes))
        for n, prediction in answers:
            assert prediction.engine == "onnxruntime"
            np.testing.assert_allclose(prediction.outputs["probs"], expected(n), rtol=1e-6)
        compiler.gate.set()
        wait_until(lambda: service.ready()[0] and bucket_state(service, "x=4x4") is BucketState.READY)
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.READY)
        assert sorted(compiler.calls.values()) == [1, 1]
        prediction = service.predict("m", {"x": rows(3)})
        assert (prediction.engine, prediction.bucket, prediction.outputs["probs"].shape) == ("tvm", "x=4x4", (3, 3))
        np.testing.assert_allclose(prediction.outputs["probs"], expected(3), rtol=1e-6)
        hits = {b["bucket"]: b["hits"] for b in service.describe("m")["buckets"]}
        assert hits == {"x=1x4": 24, "x=4x4": 25}
    finally:
        service.close()


def test_full_queue_serves_through_onnxruntime_and_queues_again_later(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), compile_queue_size=1)
    try:
        register(service, "m", DEMO, CONFIG)
        compiler.gate.clear()
        service.predict("m", {"x": rows(1)})
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.COMPILING)
        service.predict("m", {"x": rows(2)})  # takes the one queue slot
        prediction = service.predict("m", {"x": rows(3)})  # queue full: served, bucket left new
        assert prediction.engine == "onnxruntime"
        assert bucket_state(service, "x=2x4") is BucketState.ADMITTED
        assert bucket_state(service, "x=4x4") is BucketState.COLD
        with pytest.raises(UnavailableError, match="compile queue is full"):
            service.register("warm", DEMO, DEMO_CONFIG | {"warm_buckets": [{"x": [8, 4]}]})
        assert "warm" not in service.model_names
        compiler.gate.set()
        wait_until(lambda: bucket_state(service, "x=2x4") is BucketState.READY)
        service.predict("m", {"x": rows(3)})  # the next request for it queues it
        wait_until(lambda: bucket_state(service, "x=4x4") is BucketState.READY)
        assert compiler.total == 3
    finally:
        service.close()


def test_a_compile_killed_or_timed_out_is_retried_with_backoff_until_it_serves(tmp_path):
    crashes = [CompileCrashedError("compile process was killed by SIGKILL"), CompileTimeoutError("ran past 1 s")]
    compiler = FakeCompiler(errors=crashes)
    service = make_service(
        tmp_path, compiler, FakeKernels(DEMO), compile_retries=2, compile_retry_seconds=0.3, routing="compiled"
    )
    try:
        service.register_default("m", DEMO, CONFIG | {"warm_buckets": [{"x": [1, 4]}]})  # served at start
        probed(service, "m")  # the warm bucket is known once the padding probe's verdicts are
        bucket = service.get("m").buckets["x=1x4"]
        wait_until(lambda: bucket.retry_pending)
        assert bucket.reason == "compile process was killed by SIGKILL; retry 1 of 2 in 0.3 s"
        assert service.ready() == (False, ["m:x=1x4"])  # a warm bucket to be retried is still waited for
        wait_until(lambda: "retry 2 of 2 in 0.6 s" in (bucket.reason or ""))
        wait_until(lambda: service.ready()[0])
        assert bucket.state is BucketState.READY and bucket.attempts == 3
        assert service.predict("m", {"x": rows(1)}).engine == "tvm"
        assert service.metrics.compiles.retries.labels("m")._value.get() == 2
    finally:
        service.close()


def test_a_transient_failure_past_the_retries_and_a_permanent_one_stay_failed(tmp_path):
    compiler = FakeCompiler(errors=[CompileCrashedError("compile process was killed by SIGKILL")] * 2)
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), compile_retries=1, compile_retry_seconds=0.05)
    try:
        service.register_default("m", DEMO, CONFIG | {"warm_buckets": [{"x": [1, 4]}]})
        wait_until(lambda: service.ready()[0])
        bucket = service.get("m").buckets["x=1x4"]
        assert (bucket.state, bucket.reason) == (
            BucketState.FAILED,
            "compile process was killed by SIGKILL (tried 2 times)",
        )
        compiler.errors.append(UnsupportedOperatorError("no converter for Det"))
        service.register_default("p", DEMO, CONFIG | {"warm_buckets": [{"x": [2, 4]}]})
        wait_until(lambda: service.ready()[0])
        permanent = service.get("p").buckets["x=2x4"]
        assert (permanent.state, permanent.reason, permanent.attempts) == (
            BucketState.FAILED,
            "no converter for Det",
            1,
        )
        assert compiler.total == 3
    finally:
        service.close()


def test_failed_verification_leaves_the_bucket_on_onnxruntime(tmp_path):
    compiler = FakeCompiler(verified=False)
    service = make_service(tmp_path, compiler, FakeKernels(DEMO))
    try:
        service.register_default("m", DEMO, CONFIG | {"warm_buckets": [{"x": [1, 4]}]})
        wait_until(lambda: service.ready()[0])
        described = service.describe("m")["buckets"][0]
        assert described["state"] == "failed"
        assert described["reason"].startswith("verification against onnxruntime")
        assert service.predict("m", {"x": rows(1)}).engine == "onnxruntime"
        assert compiler.total == 1  # a failed bucket is not compiled again
    finally:
        service.close()


@pytest.mark.parametrize(("kernel_delay", "ort_delay", "route"), [(0.003, 0.0, "onnxruntime"), (0.0, 0.003, "tvm")])
def test_route_goes_to_the_faster_engine(tmp_path, compiler, kernel_delay, ort_delay, route):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO, delay=kernel_delay))
    try:
        served = admit(service, "m", DEMO, CONFIG)
        served.ort = SlowEngine(served.ort, ort_delay)
        service.predict("m", {"x": rows(1)})
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.READY)
        described = service.describe("m")["buckets"][0]
        assert described["engine"] == route
        assert set(described["latency_ms"]) == {"onnxruntime", "tvm"}
        assert service.predict("m", {"x": rows(1)}).engine == route
    finally:
        service.close()


@pytest.mark.parametrize(("kernel_delay", "route"), [(0.004, "onnxruntime"), (0.0015, "tvm")])
def test_a_kernel_routed_by_latency_is_measured_again_by_throughput_once_requests_run_side_by_side(
    tmp_path, compiler, kernel_delay, route
):
    """The kernel answers one request faster than ONNX Runtime (6 ms), but its calls take turns, as a kernel
    using every core does, where ONNX Runtime's overlap. Routed by latency while requests come one at a time;
    once they run side by side it is measured again at that concurrency: at 4 ms a call, 2 ONNX Runtime
    calls at once serve more; at 1.5 ms the kernel still serves more."""
    kernels = FakeKernels(DEMO, delay=kernel_delay, every_core=True)
    service = make_service(tmp_path, compiler, kernels, inference_threads=2)
    try:
        served = admit(service, "m", DEMO, CONFIG)
        served.ort = SlowEngine(served.ort, 0.006)
        service.predict("m", {"x": rows(1)})
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.READY)
        described = service.describe("m")["buckets"][0]
        assert (described["engine"], described["routed_by"]) == ("tvm", "latency")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: service.predict("m", {"x": rows(1)}), range(80)))
        for prediction in answers:
            np.testing.assert_allclose(prediction.outputs["probs"], expected(1), rtol=1e-6)
        wait_until(lambda: service.describe("m")["buckets"][0]["routed_by"] == "throughput", timeout=30)
        described = service.describe("m")["buckets"][0]
        assert described["engine"] == route, described
        assert set(described["throughput_rps"]) == {"onnxruntime", "tvm"} and described["peak_concurrency"] >= 2
        assert service.predict("m", {"x": rows(1)}).engine == route
    finally:
        service.close()


def test_route_is_restored_after_restart_without_compile_or_timing(tmp_path, compiler):
    kernels = FakeKernels(DEMO)
    first = make_service(tmp_path, compiler, kernels, routing="compiled")
    try:
        register(first, "m", DEMO, CONFIG)
        first.predict("m", {"x": rows(2)})
        wait_until(lambda: bucket_state(first, "x=2x4") is BucketState.READY)
        latency = first.describe("m")["buckets"][0]["latency_ms"]
    finally:
        first.close()

    again = FakeCompiler()
    second = make_service(tmp_path, again, kernels, routing="compiled")
    try:
        assert second.model_names == ["m"]
        prediction = second.predict("m", {"x": rows(2)})
        assert prediction.engine == "tvm"  # the first request, already on the kernel
        np.testing.assert_allclose(prediction.outputs["probs"], expected(2), rtol=1e-6)
        described = second.describe("m")["buckets"][0]
        assert (described["state"], described["latency_ms"]) == ("ready", latency)
        assert again.total == 0
        routed = second.metrics.compiles.routing.labels("m", "tvm")._value.get()
        assert routed == 0  # restored, not re-measured
    finally:
        second.close()


def test_replace_and_delete_with_requests_in_flight(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), compile_workers=0)
    try:
        v1 = admit(service, "m", DEMO, CONFIG)
        slow = v1.ort = SlowEngine(v1.ort)
        slow.hold.clear()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            in_flight = pool.submit(service.predict, "m", {"x": rows(1)})
            assert slow.entered.wait(10)
            v2 = admit(service, "m", DEMO, CONFIG, replace=True)
            assert v1.retired and not v2.retired
            assert service.predict("m", {"x": rows(1)}).version == 2
            slow.hold.set()
            assert in_flight.result(10).version == 1

            slow2 = v2.ort = SlowEngine(v2.ort)
            slow2.hold.clear()
            in_flight = pool.submit(service.predict, "m", {"x": rows(1)})
            assert slow2.entered.wait(10)
            service.delete("m")
            with pytest.raises(NotFoundError):
                service.predict("m", {"x": rows(1)})
            slow2.hold.set()
            finished = in_flight.result(10)
            assert finished.version == 2
            np.testing.assert_allclose(finished.outputs["probs"], expected(1), rtol=1e-6)
        assert v2.retired
        assert not (tmp_path / "models" / "m").exists()
    finally:
        service.close()


def test_a_retired_version_compiles_nothing_more(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO))
    try:
        v1 = admit(service, "m", DEMO, CONFIG)
        compiler.gate.clear()
        service.predict("m", {"x": rows(1)})
        assert compiler.started.wait(10)  # inside v1's compile
        service.predict("m", {"x": rows(2)})
        assert v1.buckets["x=2x4"].state is BucketState.ADMITTED
        other = FakeCompiler()
        other.gate.clear()
        service.builder._compile = other  # what runs next for any model
        admit(service, "m", DEMO, CONFIG | {"rtol": 0.5}, replace=True)
        compiler.gate.set()
        v2 = service.get("m")
        service.scheduler.enqueue(v2, v2.bucket_for({"x": (8, 4)}))  # queued behind v1's
        wait_until(other.started.is_set, what="the new version's compile")
        other.gate.set()
        assert v1.buckets["x=2x4"].state is BucketState.ADMITTED  # skipped: its version is retired
        assert list(other.calls) == [v2.buckets["x=8x4"].key]
    finally:
        service.close()


def test_routing_times_each_engine_as_it_serves_a_request_of_the_bucket(tmp_path, compiler):
    kernels = FakeKernels(DEMO)
    service = make_service(tmp_path, compiler, kernels)
    try:
        served = admit(service, "m", DEMO, CONFIG)
        ort = served.ort = SlowEngine(served.ort)
        service.predict("m", {"x": rows(5)})  # bucket x=8x4
        wait_until(lambda: bucket_state(service, "x=8x4") is BucketState.READY)
        assert len(kernels.opened) == 2  # one serves (cached), one private instance is timed
        timed = next(engine for engine in kernels.opened if engine.shapes)
        # ONNX Runtime ran a typical request of the bucket as sent, the kernel the same request padded.
        assert {"x": (7, 4)} in ort.shapes
        assert set(map(str, timed.shapes)) == {str({"x": (8, 4)})}
    finally:
        service.close()


def test_tuning_progress_is_live_and_counted_once(tmp_path, compiler):
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), routing="compiled", tune_trials_per_bucket=5)
    try:
        served = admit(service, "m", DEMO, CONFIG)
        service.predict("m", {"x": rows(1)})
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.READY)
        bucket = served.buckets["x=1x4"]
        compiler.gate.clear()
        compiler.started.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tuning = pool.submit(service.builder.tune, served, bucket)
            assert compiler.started.wait(10)
            live = wait_until(lambda: (s := service.describe("m")["buckets"][0]["tuning"]) and s.get("trials") and s)
            assert (live["state"], live["trials"], live["best_ms"]) == ("tuning", 4, 0.25)
            trials = service.metrics.compiles.tuning_trials.labels("m")
            assert trials._value.get() == 4  # counted while it runs
            compiler.gate.set()
            tuning.result(10)
        done = service.describe("m")["buckets"][0]
        assert (done["tuning"]["state"], done["tuning"]["trials"], done["engine"]) == ("done", 5, "tvm-tuned")
        assert trials._value.get() == 5  # the rest at the end, nothing twice
        assert not list(service.artifacts.staging_root.glob("progress.*"))
    finally:
        service.close()


def test_an_upload_with_warm_buckets_never_takes_a_running_server_out_of_service(tmp_path):
    compiler = FakeCompiler()
    compiler.gate.clear()
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), routing="compiled")
    try:
        assert service.ready() == (True, [])
        service.register("m", DEMO, CONFIG | {"warm_buckets": [{"x": [1, 4]}]})
        assert compiler.started.wait(10)
        bucket = service.get("m").buckets["x=1x4"]
        assert bucket.state is BucketState.COMPILING
        assert service.ready() == (True, [])  # ONNX Runtime answers it meanwhile
        assert service.predict("m", {"x": rows(1)}).engine == "onnxruntime"
        compiler.gate.set()
        wait_until(lambda: bucket.state is BucketState.READY)
        assert service.predict("m", {"x": rows(1)}).engine == "tvm"
    finally:
        compiler.gate.set()
        service.close()


def test_a_deleted_model_is_freed_after_its_requests_were_shadow_checked(tmp_path, compiler):
    """The shadow thread holds no sample between checks: a sample keeps its model's weights alive."""
    service = make_service(tmp_path, compiler, FakeKernels(DEMO), routing="compiled", shadow_rate=1)
    try:
        register(service, "m", DEMO, CONFIG)
        service.predict("m", {"x": rows(1)})
        wait_until(lambda: bucket_state(service, "x=1x4") is BucketState.READY)
        served = weakref.ref(service.get("m"))
        assert service.predict("m", {"x": rows(1)}).engine == "tvm"
        wait_until(lambda: metric_value(service.metrics.exposition().decode(), "jitserve_shadow_checks_total") >= 1)
        service.delete("m")
        gc.collect()
        assert served() is None
    finally:
        service.close()
