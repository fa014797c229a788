"""The gRPC front door: the Open Inference Protocol's ``inference.GRPCInferenceService`` (KServe's V2
protocol, as Triton's and KServe's clients speak it) in the same process and on the same event loop as
the REST server, over the same runtime."""
