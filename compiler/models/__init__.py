"""A model as the compiler sees it: ONNX bytes validated, its signature, index inputs and their
ranges, weights (prepared once per version), uploads with external data, quantized graphs, the demo."""
