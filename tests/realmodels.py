"""Real exported models for tests, fetched once into a git-ignored cache.

Packages on PyPI ship real ONNX models inside their wheels: ``pip download``
gets the wheel and the model file is unzipped from it.

- rapidocr-onnxruntime: PP-OCR text detection, direction classifier, recognizer;
- silero-vad: a voice activity detector (audio; a rank-0 sample-rate input, a recurrent state);
- magika: a file-type classifier over raw bytes (int32 input, 214 classes);
- nudenet: a YOLOv8n detector at 320x320.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "models"
CLS = "ch_ppocr_mobile_v2.0_cls_infer.onnx"
REC = "ch_PP-OCRv4_rec_infer.onnx"
DET = "ch_PP-OCRv4_det_infer.onnx"

# model name -> (the wheel's requirement, its file name prefix, the model's path inside the wheel)
WHEELS = {
    CLS: ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4", f"rapidocr_onnxruntime/models/{CLS}"),
    REC: ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4", f"rapidocr_onnxruntime/models/{REC}"),
    DET: ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime-1.4.4", f"rapidocr_onnxruntime/models/{DET}"),
    "silero_vad.onnx": ("silero-vad==6.2.3", "silero_vad-6.2.3", "silero_vad/data/silero_vad.onnx"),
    "magika.onnx": ("magika==1.0.3", "magika-1.0.3", "magika/models/standard_v3_3/model.onnx"),
    "nudenet_320n.onnx": ("nudenet==3.4.2", "nudenet-3.4.2", "nudenet/320n.onnx"),
}
VAD, MAGIKA, DETECTOR = "silero_vad.onnx", "magika.onnx", "nudenet_320n.onnx"


def real_model(name: str) -> Path:
    target = CACHE / name
    if target.is_file():
        return target
    requirement, prefix, member = WHEELS[name]
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{prefix}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), requirement],
            check=True,
        )
        found = sorted(wheels.glob(f"{prefix}-*.whl"))
    with zipfile.ZipFile(found[0]) as wheel:
        data = wheel.read(member)
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target


rapidocr_model = real_model
