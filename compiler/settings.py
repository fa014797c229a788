"""jitserve's settings: one class, read from ``JITSERVE_*`` environment
variables, every field documented."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="JITSERVE_", extra="ignore")

    data_dir: Path = Path("data")
    """Root of the model store and the artifact store; survives restarts."""

    max_model_bytes: int = 64 * 1024 * 1024
    """Largest accepted ONNX upload, in bytes."""

    target: str = "llvm"
    """Default compile target: ``llvm`` (host CPU detected), ``cuda``, or a JSON target dict."""

    cuda_arch: str = "sm_90"
    """CUDA architecture of the ``cuda`` target."""

    compile_timeout_seconds: float = 900.0
    """A compile child running longer than this is killed and the compile fails."""

    verify_rtol: float = 1e-3
    """Relative tolerance of kernel verification against ONNX Runtime."""

    verify_atol: float = 1e-4
    """Absolute tolerance of kernel verification against ONNX Runtime."""

    verify_seed: int = 0
    """Seed of the random inputs used to verify kernels and check padding safety."""

    @property
    def kernel_store_dir(self) -> Path:
        """The content-addressed artifact store of compiled kernels."""
        return self.data_dir / "kernels"
