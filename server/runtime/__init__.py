"""The serving runtime (the data plane): models, buckets, compiles, routing, inference. Never imports FastAPI."""
