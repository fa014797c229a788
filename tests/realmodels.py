"""Real exported models for tests, fetched once into a git-ignored cache.

The rapidocr-onnxruntime wheel ships PP-OCR models; ``pip download`` gets the
wheel and the model files are unzipped from it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "models"
WHEEL = "rapidocr-onnxruntime==1.4.4"
CLS = "ch_ppocr_mobile_v2.0_cls_infer.onnx"
REC = "ch_PP-OCRv4_rec_infer.onnx"
DET = "ch_PP-OCRv4_det_infer.onnx"


def rapidocr_model(name: str) -> Path:
    target = CACHE / name
    if target.is_file():
        return target
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("rapidocr_onnxruntime-1.4.4-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), WHEEL],
            check=True,
        )
        found = sorted(wheels.glob("rapidocr_onnxruntime-1.4.4-*.whl"))
    with zipfile.ZipFile(found[0]) as wheel:
        data = wheel.read(f"rapidocr_onnxruntime/models/{name}")
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target
