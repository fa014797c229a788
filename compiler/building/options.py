"""What a compile is asked to do: the compile settings (``JITSERVE_*``
environment, shared with the server), the options of one compile, and the
job handed to the compile child."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..running.precision import AccuracyBudget
from ..shapes.buckets import Bucket
from ..tvm import PIPELINE, shipped_tuning_digest

TENSOR_CORE_PRECISIONS = ("f16",)
"""The reduced precisions compiled for CUDA's tensor cores; the others (``bf16``) for the CPU's units."""
MAX_RTOL = 1.0
"""Past these a verification passes almost any kernel: a config or setting beyond them is refused."""
MAX_ATOL = 1.0


class CompileSettings(BaseSettings):
    """The settings the compiler reads; the server's settings extend this class."""

    model_config = SettingsConfigDict(env_prefix="JITSERVE_", extra="ignore", use_attribute_docstrings=True)

    data_dir: Path = Path("data")
    """Root of the model store and the artifact store; survives restarts."""

    max_model_bytes: int = 2 * 1024 * 1024 * 1024 - 1
    """Largest accepted model upload (with its external data), in bytes; protobuf caps one model at 2 GiB."""

    target: str = "llvm"
    """Default compile target: ``llvm`` (host CPU detected), ``cuda``, or a JSON target dict."""

    cuda_arch: str = "sm_90"
    """CUDA architecture of the ``cuda`` target."""

    kernel_threads: int = Field(0, ge=0)
    """Threads one kernel call may use, in TVM and ONNX Runtime alike (0: TVM takes the CPU cores this
    process may run on, ONNX Runtime its default of one pinned thread per physical core)."""

    compile_timeout_seconds: float = 900.0
    """A compile child running longer than this is killed and the compile fails."""

    compile_memory_bytes: int = Field(8 * 1024**3, ge=0)
    """Data-segment limit (RLIMIT_DATA) of one compile child, in bytes; a compile past it fails as out of
    memory and is not retried (0: no limit)."""

    verify_rtol: float = Field(1e-3, gt=0, le=MAX_RTOL, allow_inf_nan=False)
    """Relative tolerance of kernel verification against ONNX Runtime (above 0, at most 1)."""

    verify_atol: float = Field(1e-4, gt=0, le=MAX_ATOL, allow_inf_nan=False)
    """Absolute tolerance of kernel verification against ONNX Runtime (above 0, at most 1)."""

    verify_seed: int = 0
    """Seed of the random inputs used to verify kernels and check padding safety."""

    tune_trials_per_task: int = Field(16, ge=1)
    """MetaSchedule trials for one task (fused kernel) at most: the server's tuning, and ``bench
    --tune-trials``. Tasks are tuned in the order of what they lose to ONNX Runtime."""

    shipped_tuning: bool = True
    """Apply the tuning database shipped with the compiler (``compiler/tuning_db``), where it has records
    for this CPU's vector ISA and core count: a model whose kernels match workloads tuned on the project's
    machines is served tuned at its first compile. Off: only the rules and this data dir's own tuning."""

    openvino: bool = True
    """Build OpenVINO (where the ``openvino`` package is installed) for each static CPU bucket that is
    compiled (the server) or benchmarked (``python -m compiler bench``), verify it against ONNX Runtime,
    and time it beside ONNX Runtime and TVM: the server routes the bucket to it where it is fastest.
    Off: OpenVINO is never imported."""

    @property
    def kernel_store_dir(self) -> Path:
        """The content-addressed artifact store of compiled kernels."""
        return self.data_dir / "kernels"


class CompileOptions(BaseModel):
    """Knobs of one compile. Only ``key_options()`` enter the artifact key."""

    rtol: float = Field(1e-3, description="relative tolerance of verification")
    atol: float = Field(1e-4, description="absolute tolerance of verification")
    seed: int = Field(0, description="seed of the random verification inputs")
    timeout_seconds: float = Field(900.0, description="limit of one compile child process")
    memory_limit_bytes: int = Field(0, ge=0, description="data-segment limit of the compile child (0: none)")
    simplify: bool = Field(True, description="fold shape subgraphs with onnxsim before import")
    tune_trials: int = Field(0, ge=0, description="MetaSchedule trials for this bucket (0: no tuning)")
    tune_trials_per_task: int = Field(64, ge=1, description="MetaSchedule trials per task at most")
    database_dir: str | None = Field(None, description="shared tuning database, applied at every compile")
    shipped_tuning: bool = Field(True, description="apply the shipped tuning database for the CPU's ISA and cores")
    rpc_tracker: str | None = Field(None, description="host:port of a TVM RPC tracker measuring tuning candidates")
    rpc_key: str = Field("jitserve", description="device key of the tracker's RPC servers")
    nice: int = Field(0, ge=0, le=19, description="niceness added to the compile child: below serving")
    idle_priority: bool = Field(
        False, description="compile child in Linux's idle scheduling class: it runs on what serving leaves idle"
    )
    explain: bool = Field(
        True, description="write the bucket's explain bundle next to its kernel (not part of its key)"
    )
    explain_code: bool = Field(
        False, description="put the generated code (assembly; CUDA source) in the bundle: a second codegen"
    )
    budget: AccuracyBudget | None = Field(
        None, description="verify within this budget instead of the tolerances (a quantized model's int8 contract)"
    )
    precision: Literal["fp32", "bf16", "f16"] = Field(
        "fp32",
        description="bf16: matmuls by weights with bf16 operands and float32 sums (compiler/tvm/bf16.py); f16 "
        "(CUDA): matmuls with float16 operands and float32 sums on tensor cores (compiler/tvm/tensor_cores.py); "
        "verified within the budget",
    )

    cuda_graph: bool = Field(
        False,
        description="CUDA, static buckets: the VM call's kernels captured as CUDA graphs and replayed "
        "(compiler/tvm/cuda_graphs.py); a launch per kernel saved, host work that dominates small batches",
    )

    def child_limits(self) -> dict:
        """``run_in_child``'s priority and memory arguments for a child working for this compile."""
        return {"nice": self.nice, "idle_priority": self.idle_priority, "memory_limit": self.memory_limit_bytes}

    @property
    def tier(self) -> str:
        """The engine its kernel is: ``tvm``, ``tvm-tuned`` or ``tvm-bf16``."""
        if self.precision != "fp32":
            return f"tvm-{self.precision}"
        if self.cuda_graph:
            return "tvm-graph"
        return "tvm-tuned" if self.tune_trials else "tvm"

    def key_options(self) -> dict:
        # The database is not in the key: a kernel compiled with whatever records existed is
        # still verified, and keys must stay stable for a restart to find its kernels. The
        # verification settings are: a stored verdict holds only for what it was judged at.
        key = {
            "simplify": self.simplify,
            "pipeline": PIPELINE,
            "verify": {"rtol": self.rtol, "atol": self.atol, "seed": self.seed},
        }
        if self.budget is not None:
            key["verify"]["budget"] = self.budget.model_dump(exclude_none=True)
        if self.precision != "fp32":
            key["precision"] = self.precision
        if self.cuda_graph:
            key["cuda_graph"] = True
        if self.tune_trials:
            key["tune"] = [self.tune_trials, self.tune_trials_per_task]
        if self.shipped_tuning:  # its records choose schedules: a new release's file, new kernels
            key["shipped_tuning"] = shipped_tuning_digest()
        return key


@dataclass(frozen=True)
class BuildJob:
    """Everything the compile child needs; pickled across the process boundary."""

    model_source: bytes | str
    """The model as uploaded (ONNX Runtime's reference): its bytes, or the path of its stored file."""
    prepared_dir: str
    """The model version's prepared folder: the graph compiled and the weights the kernel takes."""
    bucket: Bucket
    dtypes: dict[str, str]
    input_names: list[str]
    output_names: list[str]
    target: dict
    library_path: str
    rtol: float
    atol: float
    seed: int
    simplify: bool
    tune_trials: int = 0
    tune_trials_per_task: int = 64
    database_dir: str | None = None
    shipped_tuning: bool = True
    rpc_tracker: str | None = None
    """``host:port`` of the TVM RPC tracker whose servers measure tuning candidates (None: this machine)."""
    rpc_key: str = "jitserve"
    index_limits: dict[str, int] | None = None
    """input -> size of the dimension it indexes: verification inputs stay below it."""
    progress_path: str | None = None
    """Where tuning writes its progress (``{"trials", "best_ms"}``) as it goes."""
    tune_seconds: float | None = None
    """No tuning task starts that would not end within this (the build and verification follow)."""
    kernel_times: dict[str, tuple[float | None, float | None]] | None = None
    """The untuned kernel's explain profile (kernel -> its ms, ONNX Runtime's ms): what ranks the tuning tasks."""
    verify_sizes: dict[str, list[int]] | None = None
    """A symbolic bucket's named dim -> the sizes it is verified at (one kernel serves them all)."""
    explain_dir: str | None = None
    """Where to write the bucket's explain bundle (IR per stage, kernels traced to ONNX nodes)."""
    explain_code: bool = False
    """Whether the bundle holds the generated code too (assembly, CUDA source)."""
    budget: dict | None = None
    """An :class:`~compiler.running.precision.AccuracyBudget`'s fields: verified within it, not the
    tolerances."""
    precision: str = "fp32"
    """``bf16``: the matmuls by weights computed in bf16 (``compile_relax``'s ``precision``)."""
    cuda_graph: bool = False
    """The kernels captured as CUDA graphs (``compile_relax``'s ``cuda_graph``)."""


@dataclass(frozen=True)
class PrepareJob:
    """The compile child's job of preparing a model version's weights (:mod:`compiler.tvm.prepare`)."""

    model_source: bytes | str
    directory: str
    simplify: bool


def read_source(source: bytes | str) -> bytes:
    """A job's model: the bytes themselves, or read from the stored file."""
    if isinstance(source, bytes):
        return source
    with open(source, "rb") as handle:
        return handle.read()
