"""jitserve's compiler: ONNX models -> verified per-bucket TVM kernels."""
