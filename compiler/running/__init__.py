"""Engines behind one interface (ONNX Runtime, TVM, OpenVINO), seeded inputs and output
comparison, and the precision contract's budgets."""
