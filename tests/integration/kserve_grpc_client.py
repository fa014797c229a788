"""KServe's own gRPC client (``InferenceGRPCClient``) against a jitserve gRPC target, run in KServe's
environment like ``kserve_client.py``: liveness, readiness, and infer with typed and with raw contents.
Prints one JSON object for the test to check. ``python kserve_grpc_client.py HOST:PORT MODEL``"""

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest


async def main(target: str, model: str) -> dict:
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) - 6) / 4
    async with InferenceGRPCClient(target, timeout=30) as client:
        found = {
            "live": await client.is_server_live(),
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready(model),
            "input": x.tolist(),
        }
        for raw in (False, True):
            tensor = InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=raw)
            request = InferRequest(model, [tensor], request_id=f"kserve-grpc-{raw}")
            response = await client.infer(request)
            found["raw" if raw else "typed"] = {
                "id": response.id,
                "model_name": response.model_name,
                "probs": response.outputs[0].as_numpy().tolist(),
            }
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
