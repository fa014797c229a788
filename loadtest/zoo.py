"""The model zoo: standard convnet architectures, exported to ONNX with random weights, for benchmarks.

    make zoo                                  # the environment with torch, then every model
    .cache/zoo-venv/bin/python loadtest/zoo.py [--only resnet50 ...] [--list]

The speed of a network is its architecture's, not its weights': each model is torchvision's with
seeded random weights (no download), exported once by torch's TorchScript exporter (opset 17, the
form most models users bring were exported in) with a symbolic batch axis, and written atomically to
``.cache/zoo/v<ZOO_VERSION>/<name>.onnx``. BatchNorm's scales are random and its statistics measured on random
images (``calibrate``), so that folding them into the convolutions makes ordinary weights and
activations stay near unit scale, as in a trained network. torch lives in an environment of its own
(``.cache/zoo-venv``, several GB): neither the server nor its tests import it. The YOLOv8n detector of
the zoo is the real one shipped in nudenet's wheel (``tests/realmodels.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Bumped when the export changes the models (2: BatchNorm statistics calibrated): a cache of older exports
# is left aside, not reused.
ZOO_VERSION = 2
ZOO = REPO / ".cache" / "zoo" / f"v{ZOO_VERSION}"

# name -> (torchvision builder, keyword arguments, input shape at batch 1)
ARCHITECTURES: dict[str, tuple[str, dict, tuple[int, ...]]] = {
    "resnet50": ("resnet50", {}, (1, 3, 224, 224)),
    "mobilenet_v3_large": ("mobilenet_v3_large", {}, (1, 3, 224, 224)),
    "efficientnet_b0": ("efficientnet_b0", {}, (1, 3, 224, 224)),
    "resnext50_32x4d": ("resnext50_32x4d", {}, (1, 3, 224, 224)),  # grouped 3x3 convs
    "regnet_y_800mf": ("regnet_y_800mf", {}, (1, 3, 224, 224)),  # grouped convs and squeeze-excitation
    "densenet121": ("densenet121", {}, (1, 3, 224, 224)),  # concatenations of growing width
    "convnext_tiny": ("convnext_tiny", {}, (1, 3, 224, 224)),  # 7x7 depthwise, layer norm, GELU
    "deeplabv3_mobilenet_v3_large": (
        "segmentation.deeplabv3_mobilenet_v3_large",
        {"weights_backbone": None, "aux_loss": False},
        (1, 3, 224, 224),
    ),  # dilated convs, resize back to the input
}


def zoo_path(name: str) -> Path:
    return ZOO / f"{name}.onnx"


def export(name: str) -> Path:
    import torch
    import torchvision

    builder, kwargs, shape = ARCHITECTURES[name]
    torch.manual_seed(0)
    module = torchvision.models
    for part in builder.split("."):
        module = getattr(module, part)
    model = module(weights=None, **kwargs)
    calibrate(torch, model, shape)
    if builder.startswith("segmentation."):
        model = _first_output(torch, model)
    path = zoo_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    torch.onnx.export(
        model,
        (torch.randn(*shape),),
        str(partial),
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    partial.replace(path)
    return path


def calibrate(torch, model, shape: tuple[int, ...]) -> None:
    """BatchNorm scales and shifts at random, and its statistics measured on random images, as training
    leaves them: activations stay near unit scale through the network, as in a trained one. With random
    statistics ResNet-50's logits reached +-370, where fp32's summation order alone moves a logit near
    zero past any sound relative tolerance."""
    norms = [layer for layer in model.modules() if isinstance(layer, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        for layer in norms:
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.uniform_(-0.1, 0.1)
            layer.reset_running_stats()
            layer.momentum = None  # a cumulative average over the calibration batches
        model.train()
        for _ in range(4):
            model(torch.randn(8, *shape[1:]))
    model.eval()


def _first_output(torch, model):
    """Segmentation models answer a dict of tensors; the export wants the tensor."""

    class FirstOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x):
            return self.model(x)["out"]

    return FirstOutput().eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(ARCHITECTURES), help="export these only")
    parser.add_argument("--list", action="store_true", help="print the zoo as JSON lines and export nothing")
    parser.add_argument("--force", action="store_true", help="export again what the cache holds")
    args = parser.parse_args()
    for name in args.only or sorted(ARCHITECTURES):
        path = zoo_path(name)
        if not args.list and (args.force or not path.is_file()):
            export(name)
        shape = ARCHITECTURES[name][2]
        print(json.dumps({"model": name, "path": str(path.relative_to(REPO)), "shape": shape}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
