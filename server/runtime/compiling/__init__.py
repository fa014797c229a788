"""Compiling buckets: the queue and its workers, compile admission, the build step, routing
between engines (TVM, OpenVINO, ONNX Runtime), background tuning."""
