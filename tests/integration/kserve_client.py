"""KServe's own REST client against a jitserve URL, run in an environment of its own (KServe's SDK
pins clash with jitserve's): liveness, readiness, and infer with JSON and with binary tensors.
Prints one JSON object for the test to check. ``python kserve_client.py URL MODEL``"""

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput


async def main(url: str, model: str) -> dict:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    x = (np.arange(12, dtype=np.float32).reshape(3, 4) - 6) / 4
    found = {
        "live": await client.is_server_live(url),
        "ready": await client.is_server_ready(url),
        "model_ready": await client.is_model_ready(url, model),
        "input": x.tolist(),
    }
    for binary in (False, True):
        tensor = InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=binary)
        outputs = [RequestedOutput("probs", parameters={"binary_data": binary})]
        request = InferRequest(model, [tensor], request_id=f"kserve-{binary}", request_outputs=outputs)
        response = await client.infer(url, request, model_name=model)
        found["binary" if binary else "json"] = {
            "id": response.id,
            "model_name": response.model_name,
            "probs": response.outputs[0].as_numpy().tolist(),
        }
    await client.close()
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
