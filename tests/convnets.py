"""A CI-sized slice of the model zoo (``loadtest/zoo.py``): a few blocks of each convnet family, built
with ``onnx.helper`` at small widths, with the conv kinds the zoo's models have: the 3-channel first
layer, strided, 1x1, depthwise, grouped and dilated convs, residual adds in front of a conv,
squeeze-excitation, hardswish and SiLU, pooling (max, average, global), concat and resize, and
ConvNeXt's channels-last MLP (MatMuls by 2-D weights over the map)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tests.synthetic import make_model, value


class Net:
    """Nodes and seeded weights, added one op at a time; each method returns its output's name."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, op: str) -> str:
        self.count += 1
        return f"{op.lower()}{self.count}"

    def constant(self, array: np.ndarray) -> str:
        name = self._name("w")
        self.weights.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op: str, *inputs: str, **attributes) -> str:
        out = self._name(op)
        self.nodes.append(helper.make_node(op, list(inputs), [out], **attributes))
        return out

    def conv(self, x: str, c_in: int, c_out: int, k: int, *, stride=1, group=1, dilation=1) -> str:
        fan_in = c_in // group * k * k
        w = (self.rng.standard_normal((c_out, c_in // group, k, k)) / np.sqrt(fan_in)).astype(np.float32)
        b = (self.rng.standard_normal(c_out) * 0.1).astype(np.float32)
        pad = dilation * (k - 1) // 2
        return self.op(
            "Conv", x, self.constant(w), self.constant(b), kernel_shape=[k, k], strides=[stride, stride],
            pads=[pad] * 4, group=group, dilations=[dilation, dilation],
        )  # fmt: skip

    def batch_norm(self, x: str, channels: int) -> str:
        """An inference BatchNormalization with non-trivial statistics (DenseNet's pre-activation norm,
        which no conv in front of it absorbs)."""
        scale, bias, mean = (self.rng.standard_normal(channels).astype(np.float32) for _ in range(3))
        var = self.rng.uniform(0.5, 2.0, channels).astype(np.float32)
        return self.op("BatchNormalization", x, *(self.constant(a) for a in (scale, bias, mean, var)), epsilon=1e-3)

    def silu(self, x: str) -> str:
        return self.op("Mul", x, self.op("Sigmoid", x))

    def squeeze_excite(self, x: str, channels: int, squeezed: int) -> str:
        pooled = self.op("GlobalAveragePool", x)
        scale = self.op("HardSigmoid", self.conv(self.op("Relu", self.conv(pooled, channels, squeezed, 1)),
                                                 squeezed, channels, 1), alpha=1 / 6, beta=0.5)  # fmt: skip
        return self.op("Mul", x, scale)

    def classifier(self, x: str, channels: int, classes: int = 10) -> str:
        flat = self.op("Flatten", self.op("GlobalAveragePool", x))
        w = (self.rng.standard_normal((classes, channels)) / np.sqrt(channels)).astype(np.float32)
        return self.op("Gemm", flat, self.constant(w), self.constant(np.zeros(classes, np.float32)), transB=1)

    def linear(self, x: str, c_in: int, c_out: int) -> str:
        """A channels-last linear layer as torch exports it over a map: MatMul by (c_in, c_out), Add."""
        w = (self.rng.standard_normal((c_in, c_out)) / np.sqrt(c_in)).astype(np.float32)
        b = (self.rng.standard_normal(c_out) * 0.1).astype(np.float32)
        return self.op("Add", self.op("MatMul", x, self.constant(w)), self.constant(b))

    def gelu(self, x: str) -> str:
        """GELU as torch exports it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
        scaled = self.op("Div", x, self.constant(np.array(np.sqrt(2.0), np.float32)))
        erf = self.op("Add", self.op("Erf", scaled), self.constant(np.array(1.0, np.float32)))
        return self.op("Mul", self.op("Mul", x, erf), self.constant(np.array(0.5, np.float32)))

    def model(self, name: str, out: str, out_dims: list) -> bytes:
        self.nodes[-1].output[0] = "y"
        inputs = [value("x", "float32", ["N", 3, "H", "W"])]
        graph = helper.make_graph(self.nodes, name, inputs, [value("y", "float32", out_dims)], self.weights)
        return make_model(graph).SerializeToString()


def residual_model(width: int = 16) -> bytes:
    """ResNet's stem (7x7 stride-2 conv on 3 channels, 3x3 stride-2 max pool), a bottleneck that
    downsamples (1x1, 3x3 stride 2, 1x1; its shortcut a 1x1 stride-2 conv) and one with an identity
    shortcut, whose input is the previous block's add: the residual add fused in front of a conv."""
    n = Net(21)
    x = n.op("MaxPool", n.op("Relu", n.conv("x", 3, width, 7, stride=2)), kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 1, 1, 1])  # fmt: skip
    wide = 4 * width
    inner = n.op("Relu", n.conv(n.op("Relu", n.conv(x, width, width, 1)), width, width, 3, stride=2))
    block = n.op("Relu", n.op("Add", n.conv(inner, width, wide, 1), n.conv(x, width, wide, 1, stride=2)))
    inner = n.op("Relu", n.conv(n.op("Relu", n.conv(block, wide, width, 1)), width, width, 3))
    block = n.op("Relu", n.op("Add", n.conv(inner, width, wide, 1), block))
    return n.model("residual", n.classifier(block, wide), ["N", 10])


def mobile_model(width: int = 16) -> bytes:
    """MobileNetV3 and EfficientNet blocks: a hardswish stem, an inverted residual (1x1 expand, 3x3
    depthwise, squeeze-excitation, 1x1 project, residual add) and a SiLU one with a 5x5 stride-2
    depthwise conv."""
    n = Net(22)
    x = n.op("HardSwish", n.conv("x", 3, width, 3, stride=2))
    wide = 4 * width
    expanded = n.op("HardSwish", n.conv(x, width, wide, 1))
    depthwise = n.op("HardSwish", n.conv(expanded, wide, wide, 3, group=wide))
    x = n.op("Add", n.conv(n.squeeze_excite(depthwise, wide, width), wide, width, 1), x)
    expanded = n.silu(n.conv(x, width, wide, 1))
    depthwise = n.silu(n.conv(expanded, wide, wide, 5, stride=2, group=wide))
    x = n.conv(n.squeeze_excite(depthwise, wide, width), wide, 2 * width, 1)
    return n.model("mobile", n.classifier(x, 2 * width), ["N", 10])


def branches_model(width: int = 16) -> bytes:
    """ResNeXt's grouped 3x3 conv, DeepLab's dilated one, DenseNet's concat, pre-activation norm and
    average pool, and a 2x nearest resize back up to a segmentation head's size."""
    n = Net(23)
    x = n.op("Relu", n.conv("x", 3, 2 * width, 3, stride=2))
    grouped = n.op("Relu", n.conv(x, 2 * width, 2 * width, 3, group=4))
    dilated = n.op("Relu", n.conv(x, 2 * width, width, 3, dilation=2))
    joined = n.op("Relu", n.batch_norm(n.op("Concat", grouped, dilated, axis=1), 3 * width))
    pooled = n.op("AveragePool", joined, kernel_shape=[2, 2], strides=[2, 2])
    head = n.conv(n.op("Relu", n.conv(pooled, 3 * width, width, 1)), width, 4, 1)
    scales = n.constant(np.array([1, 1, 2, 2], np.float32))
    n.op("Resize", head, "", scales, mode="nearest")
    return n.model("branches", "y", ["N", 4, "H2", "W2"])


def convnext_model(width: int = 16) -> bytes:
    """ConvNeXt's patchify stem (4x4 stride-4 conv) and a block: 7x7 depthwise conv, channels-last
    LayerNorm and MLP (MatMuls by 2-D weights over the map, GELU between them), back to channels
    first, residual add."""
    n = Net(24)
    x = n.conv("x", 3, width, 4, stride=4)
    last = n.op("Transpose", n.conv(x, width, width, 7, group=width), perm=[0, 2, 3, 1])
    scale, bias = np.ones(width, np.float32), np.zeros(width, np.float32)
    normed = n.op("LayerNormalization", last, n.constant(scale), n.constant(bias), axis=-1, epsilon=1e-6)
    mlp = n.linear(n.gelu(n.linear(normed, width, 4 * width)), 4 * width, width)
    x = n.op("Add", n.op("Transpose", mlp, perm=[0, 3, 1, 2]), x)
    return n.model("convnext", n.classifier(x, width), ["N", 10])
