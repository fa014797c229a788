"""jitserve's settings: one class, read from ``JITSERVE_*`` environment
variables, every field documented. The compile settings it extends are
:class:`compiler.building.options.CompileSettings` (the CLI reads those alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from compiler.building.options import CompileSettings


class GenerationSettings(CompileSettings):
    """The settings of generative decoding (``/v2/models/{name}/generate``); the server's settings extend
    this class."""

    generate_cache_bytes: int = Field(512 * 1024**2, ge=0)
    """Key/value cache memory of one decoder model's generate sequences, in bytes: a sequence reserves the
    blocks its prompt and ``max_tokens`` fill before it starts, and is refused with 503 where they are not
    free."""

    generate_block_positions: int = Field(16, ge=1)
    """Positions of one key/value cache block (the unit sequences reserve in)."""

    generate_max_batch: int = Field(8, ge=1)
    """Sequences of one decoder model decoded together in one step at most; more wait to join."""

    generate_max_waiting: int = Field(64, ge=0)
    """Sequences of one decoder model waiting to join the batch at most; past it, 503."""

    generate_max_tokens: int = Field(1024, ge=1)
    """The largest ``max_tokens`` a generate request may ask for."""

    generate_ort_threads: int = Field(0, ge=0)
    """Intra-op threads of a decoder model's ONNX Runtime session (0: as ``kernel_threads``), which spin
    while a call lasts and stop as it ends. Its generation loop calls it step after step from one thread;
    measured on 2 cores (GPT-2 small, 128 cached positions): 17.5 ms a step on two threads so, 24.4 ms on one
    thread without spinning (``ort_threads``' default for other models)."""


class InferenceSettings(GenerationSettings):
    """Where requests run: the inference threads, the event loop, ONNX Runtime's threads; the server's
    settings extend this class."""

    inference_threads: int = Field(2, ge=1)
    """Threads running inference off the event loop, shared by models by weighted fair queueing (config
    ``weight``); while several models are asked, none holds them all."""

    inference_threads_per_model: int = Field(0, ge=0)
    """Most inference threads one model holds at once (0: all but one while others are asked, else all)."""

    cold_lane: bool = True
    """Run requests to new shapes (buckets that have not earned a compile yet) on threads of their own in
    Linux's idle scheduling class, so a storm of new shapes takes only the CPU established traffic leaves
    (PP-OCR rec on 2 cores, 1,000 random widths: hot-shape p99 x1.66-1.72 without, x1.26-1.39 with). Complete
    with ``ort_threads`` 1, where ONNX Runtime runs on the calling thread."""

    inference_queue_size: int = Field(64, ge=0)
    """Predictions that may wait for an inference thread; past it requests answer 503."""

    inline_max_ms: float = Field(0.1, ge=0)
    """Buckets whose engine runs average below this (ms) run on the event loop: cheaper than the hop to
    an inference thread and back (measured ~40 us of CPU and a 5x worse p99 on a tiny model). 0: never."""

    ort_threads: int = Field(1, ge=0)
    """Intra-op threads of each served ONNX Runtime session (0: as ``kernel_threads``). One: requests
    run side by side on the inference threads instead; measured on 2 cores (PP-OCR cls, no spinning),
    one thread ran batch 1 in 0.91 ms against 1.32 ms on two, and batch 8 in the same 8 ms."""

    ort_spinning: bool = False
    """Let ONNX Runtime's idle intra-op threads spin between calls. Off: spinning threads hold the
    cores a TVM call in the same process needs next (measured 4-13x slower TVM calls on 2 cores)."""


class Settings(InferenceSettings):
    """Everything the server reads: the compile settings plus serving, routing and tuning."""

    host: str = "127.0.0.1"
    """Address the HTTP server binds; a non-loopback address requires ``admin_token``."""

    port: int = 8000
    """TCP port of the HTTP server."""

    grpc_port: int = Field(8001, ge=0, le=65535)
    """TCP port of the gRPC server (the Open Inference Protocol's ``inference.GRPCInferenceService``), on
    ``host`` beside HTTP; 0: no gRPC."""

    admin_token: str | None = None
    """When set, ``PUT`` and ``DELETE`` on models need ``Authorization: Bearer <token>``."""

    access_log: bool = False
    """Log one line per HTTP request (uvicorn's access log): costs ~8% of a tiny model's throughput."""

    demo_model: bool = True
    """Register the built-in ``demo`` model when the model store is empty."""

    model_watch_seconds: float = Field(1.0, ge=0)
    """How often to look for models another replica on the same data dir uploaded, replaced or deleted
    (0: never; one replica alone needs no watch)."""

    max_predict_bytes: int = 16 * 1024 * 1024
    """Largest accepted ``/predict`` (JSON) request body, in bytes."""

    max_infer_bytes: int = 64 * 1024 * 1024
    """Largest accepted V2 infer request body (REST) or message (gRPC), in bytes: carries a batch of eight
    640x640 RGB float32 images as binary tensors or raw contents (~39 MiB)."""

    max_tensor_bytes: int = Field(4 * 1024**3, ge=1)
    """Largest tensor a model may need, in bytes: an input at its smallest, a tensor whose shape is static
    (a ``ConstantOfShape`` of 4 TB), or an input at a config's probe sizes, warm buckets or dynamic range.
    A model or config past it is refused at upload, before anything allocates it."""

    shadow_rate: float = Field(0.05, ge=0, le=1)
    """Share of the requests a compiled kernel answers that run again on ONNX Runtime, off the hot path at
    idle priority, and are compared with the bucket's tolerance: a kernel that differs is demoted (its bucket
    routes to ONNX Runtime for good, with the reason). 0: no shadow checks."""

    shadow_max_per_second: float = Field(5.0, gt=0)
    """At most this many shadow checks start in any one second, whatever the traffic; samples past it are
    dropped (counted), never delayed."""

    shadow_queue_size: int = Field(8, ge=1)
    """Sampled requests waiting for their shadow check; a sample that finds the queue full is dropped."""

    max_symbolic_axes: int = Field(256, ge=1)
    """Most symbolic axes a model may have (each costs the upload a padding probe, and each request a
    bucket dimension); a model with more is refused at upload, naming its count."""

    probe_seconds: float = Field(30.0, gt=0)
    """Time a model's padding-safety probe may take (two ONNX Runtime runs per symbolic axis): axes not
    probed by then are served exactly. The probe runs after the upload has answered, in the background."""

    max_body_bytes_in_flight: int = Field(128 * 1024 * 1024, ge=0)
    """Bytes of predict and infer bodies held at once (JSON parses to several times its size in memory;
    16 bodies of 16 MiB took the server from 119 MB to 2 GB): past it a request waits for others to finish,
    up to ``body_wait_seconds``, then answers 503. A body over the budget runs alone. 0: unbounded."""

    body_wait_seconds: float = Field(10.0, ge=0)
    """How long a request waits for room in ``max_body_bytes_in_flight`` before answering 503."""

    json_parse_processes: int = Field(1, ge=0)
    """Child processes parsing ``/predict`` bodies over 1 MiB, so that parsing (which holds Python's GIL,
    ~135 ms per 16 MiB) never stalls other requests or ``/healthz``. 0: parsed on the inference threads."""

    compile_workers: int = Field(1, ge=0)
    """Compiles running at once, each in its own child process; 0 serves everything through ONNX Runtime."""

    compile_queue_size: int = Field(32, ge=1)
    """Compiles that may wait; past it uploads with warm buckets answer 503."""

    compile_min_hits: int = Field(3, ge=1, le=64)
    """Requests a bucket must serve within ``compile_hit_window_seconds`` before it earns a compile;
    until then ONNX Runtime serves it. Warm buckets are exempt."""

    compile_hit_window_seconds: float = Field(60.0, gt=0)
    """The sliding window of compile admission: hits, new buckets (storms) and the compile budget count
    over it; a bucket's traffic (which orders the queue and picks evictions) decays with it."""

    max_compiled_buckets: int = Field(16, ge=1)
    """Buckets of one model compiled, compiling or admitted at most; past it a bucket with twice the recent
    traffic evicts the coldest compiled one (served by ONNX Runtime again; its kernel stays stored). Warm
    buckets are exempt."""

    compiles_per_window: int = Field(8, ge=1)
    """Compiles admitted over all models within one window (kernels already stored reload for free)."""

    storm_new_buckets: int = Field(32, ge=1)
    """New shapes (new buckets, and new sizes of a dynamic bucket) one model may see within one window;
    past it the model is in a shape storm: no new compiles are admitted for it until the rate falls (a
    dynamic bucket's admitted compile waits in the queue too), and ONNX Runtime serves its buckets without
    a kernel on the cold lane."""

    compile_retries: int = Field(2, ge=0)
    """Times a compile is tried again after it failed for a reason that may pass (its child was killed by
    a signal, crashed, or ran past its timeout); an unsupported operator or a failed verification is
    never retried."""

    compile_retry_seconds: float = Field(30.0, gt=0)
    """Wait before the first retry of a failed compile; it doubles for each retry after."""

    explain_bundles: bool = True
    """Write each compiled bucket's explain bundle beside its kernel (IR per stage, kernels traced to ONNX
    nodes; no generated code): 1.3-2.3 s of a PP-OCR compile of 8-12 s. Off: kernels come without one."""

    compile_nice: int = Field(10, ge=0, le=19)
    """Niceness of compile children: below serving, so a compile takes only what requests leave. 19 for
    the least share; tuning children always run at idle priority."""

    shutdown_grace_seconds: float = Field(10.0, ge=0)
    """On SIGTERM: new connections and gRPC calls are refused at once, requests and calls in flight get
    this long to finish; compile and tuning children are stopped."""

    compile_idle_priority: bool = False
    """Compile children in Linux's idle scheduling class too: any runnable request preempts them at once
    (niceness only lowers their share). A compile may then wait long on cores kept busy by traffic."""

    kernel_input_max_abs: float = Field(1e6, gt=0)
    """Requests with a float input beyond this magnitude, or not finite, are served by ONNX Runtime, never
    by a kernel: kernels are verified on ordinary values, and a fused kernel orders overflowing arithmetic
    differently (all-3e38 inputs gave NaN from ONNX Runtime and finite numbers from a kernel)."""

    kernel_cache_entries: int = Field(64, ge=1)
    """Most kernels held loaded in memory (LRU); evicted ones reload from the store."""

    kernel_cache_bytes: int = 1024 * 1024 * 1024
    """Most bytes held by loaded kernels (LRU): each kernel's code and the workspace it keeps between runs,
    measured when it was verified. The weights are not counted here: once per model version, they are the
    model's memory (see ``memory_bytes``)."""

    max_transformed_weights_ratio: float = Field(2.0, ge=0)
    """What a model version's kernels may compute from its weights at load (matmul panels, channel-blocked
    conv weights), in multiples of the weights' bytes (int8 ones counted as their int16 panels); 0: no bound.
    Buckets whose kernels read the same layout share one copy; a kernel that needs a layout of its own past
    this bound is not loaded, its bucket served by the other engines. ``GET /models/{name}`` reports it."""

    memory_bytes: int | None = Field(None, ge=0)
    """Memory the server may use (none: the container's limit, else the machine's). An upload whose weights
    would take the server and its children past it (4x the weights while it loads: its bytes, the parsed
    model, ONNX Runtime's session being built) is refused with 507 instead of the server being killed for
    memory later. 0: no check."""

    explain_profile_seconds: float = Field(120.0, gt=0)
    """An explain profile (``POST /models/{name}/buckets/{bucket}/explain/profile``) is stopped past this:
    its child loads the kernel and an ONNX Runtime session and times both, at a compile's priority."""

    malloc_mmap_threshold_bytes: int = Field(1024 * 1024, ge=0)
    """Blocks this large or larger are mapped on their own and go back to the system when freed (glibc's
    ``M_MMAP_THRESHOLD``), so a deleted model's memory is handed back instead of staying in the heap
    between live blocks. Requests with tensors past it pay a fresh mapping per tensor (about 0.4 ms a
    MiB). 0: glibc's moving threshold."""

    kernel_store_bytes: int = Field(10 * 1024**3, ge=0)
    """Budget of the artifact store on disk (kernels and each model version's prepared weights). Past it a
    sweep removes kernels and weights of deleted models and superseded versions first, then the least
    recently used kernels (compiled again if needed); never a kernel in use, never a stored version's
    weights. 0: no budget."""

    kernel_store_grace_seconds: float = Field(600.0, gt=0)
    """The store's budget removes only what no process has used for this long: a replica still serving an
    old version, or loading a kernel a peer just built, finishes first."""

    kernel_store_sweep_seconds: float = Field(60.0, gt=0)
    """How often the store's budget is enforced (and what this process holds is marked as used); shorter
    than ``kernel_store_grace_seconds``."""

    routing: Literal["measured", "compiled"] = "measured"
    """``measured``: each bucket is served by its fastest verified engine, timed on the bucket;
    ``compiled``: by its verified TVM kernel whenever there is one, its bf16 one first where the precision
    contract allows it (else OpenVINO where it verified)."""

    routing_runs: int = Field(10, ge=1)
    """Timed runs per engine when a bucket is routed (the median decides)."""

    tvm_bf16: Literal["unit", "always", "off"] = "unit"
    """TVM's bf16 tier, for a model whose precision contract allows ``bf16``: each CPU bucket compiled once
    more with its matmuls and convs by weights in bf16 (float32 sums), verified within the contract's
    budget, and routed to where it measures fastest. ``unit``: on a CPU with AVX512-BF16 or AMX only;
    ``always``: on any CPU (without the unit the same bf16 products are widened and summed by unscheduled
    loops, many times slower: for checking the tier on such a machine); ``off``: never."""

    tuning_enabled: bool = True
    """Tune the busiest ready buckets with MetaSchedule in the background."""

    tune_trials_per_bucket: int = Field(64, ge=1)
    """MetaSchedule trials for one bucket (over all its tasks)."""

    tuning_seconds_per_bucket: float = Field(600.0, gt=0)
    """A bucket's tuning child is stopped past this (the bucket stays on its current engine)."""

    tuning_total_seconds: float = Field(3600.0, ge=0)
    """Tuning time budget of one server process, over all buckets."""

    tune_min_hits: int = Field(50, ge=1)
    """Requests a bucket must have served before it qualifies for tuning."""

    tune_top_buckets: int = Field(2, ge=1)
    """Per model, only this many of the busiest buckets qualify for tuning."""

    tuning_interval_seconds: float = Field(30.0, gt=0)
    """How often the background tuner looks for a bucket to tune."""

    tuning_rpc_tracker: str | None = Field(None, pattern=r"^[^:\s]+:[0-9]{1,5}$")
    """``host:port`` of a TVM RPC tracker: tuning measures its candidates on the RPC servers registered
    there under ``tuning_rpc_key`` (a tuning box or idle replicas), not on this machine (none: here)."""

    tuning_rpc_key: str = Field("jitserve", pattern=r"^[A-Za-z0-9_.-]+$")
    """The device key the tracker's RPC servers registered under (``rpc_server --key``)."""

    @model_validator(mode="after")
    def _sweeps_within_grace(self) -> Settings:
        # A peer's kernels in memory are marked used at each of its sweeps: a longer sweep lets them look idle.
        if self.kernel_store_sweep_seconds >= self.kernel_store_grace_seconds:
            raise ValueError("kernel_store_sweep_seconds must be shorter than kernel_store_grace_seconds")
        return self

    @property
    def model_store_dir(self) -> Path:
        """Uploaded models, one directory per name and version."""
        return self.data_dir / "models"
