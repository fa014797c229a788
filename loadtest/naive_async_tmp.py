"""The peer jitserve's request path is measured against: the 15-line FastAPI + ONNX Runtime
server a newcomer writes. ``NAIVE_MODEL=model.onnx uvicorn loadtest.naive_server:app``"""

import os

import numpy as np
import onnxruntime as ort
from fastapi import FastAPI

session = ort.InferenceSession(os.environ["NAIVE_MODEL"])
DTYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(int64)": np.int64}
app = FastAPI()


@app.post("/predict")
async def predict(body: dict) -> dict:
    inputs = {i.name: np.asarray(body["inputs"][i.name], DTYPES[i.type]) for i in session.get_inputs()}
    outputs = session.run(None, inputs)
    return {"outputs": {o.name: v.tolist() for o, v in zip(session.get_outputs(), outputs, strict=True)}}
