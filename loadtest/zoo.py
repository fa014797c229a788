"""The model zoo: standard convnet and transformer architectures, exported to ONNX with random weights,
for benchmarks.

    make zoo                                  # the environment with torch, then every model
    .cache/zoo-venv/bin/python loadtest/zoo.py [--only resnet50 ...] [--list]

The speed of a network is its architecture's, not its weights': each convnet is torchvision's with
seeded random weights (no download), exported once by torch's TorchScript exporter (opset 17, the
form most models users bring were exported in) with a symbolic batch axis, and written atomically to
``.cache/zoo/v<ZOO_VERSION>/<name>.onnx``. BatchNorm's scales are random and its statistics measured on random
images (``calibrate``), so that folding them into the convolutions makes ordinary weights and
activations stay near unit scale, as in a trained network. torch lives in an environment of its own
(``.cache/zoo-venv``, several GB): neither the server nor its tests import it. The YOLOv8n detector of
the zoo is the real one shipped in nudenet's wheel (``tests/realmodels.py``). The transformers
(``TRANSFORMERS``) are torchvision's ViT-B/16 and Hugging Face's GPT-2 small and BERT-base, the last two
exported by the dynamo exporter with symbolic batch and sequence axes. The decoders (``DECODERS``) are
GPT-2 small again, with its key/value cache as inputs and outputs, for the generation loop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Bumped when the export changes the models (2: BatchNorm statistics calibrated; 3: ViT-B/16's classifier
# drawn at random): a cache of older exports is left aside, not reused.
ZOO_VERSION = 3
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
    "shufflenet_v2_x1_0": ("shufflenet_v2_x1_0", {}, (1, 3, 224, 224)),  # channel shuffle, split and concat
    "squeezenet1_1": ("squeezenet1_1", {}, (1, 3, 224, 224)),  # fire modules: squeeze, parallel expands
    "deeplabv3_mobilenet_v3_large": (
        "segmentation.deeplabv3_mobilenet_v3_large",
        {"weights_backbone": None, "aux_loss": False},
        (1, 3, 224, 224),
    ),  # dilated convs, resize back to the input
}

# Transformers: name -> (export function's name, input name -> shape at the smallest bucket). ViT-B/16 is
# torchvision's (its attention is nn.MultiheadAttention); GPT-2 small and BERT-base are Hugging Face
# transformers' with eager attention (explicit MatMul, scale, mask and Softmax, as exports users bring
# through optimum have it), exported by torch's dynamo exporter: the TorchScript one fails on
# transformers' masking (``aten::diff``).
TRANSFORMERS: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {
    "vit_b_16": ("_export_vit", {"x": (1, 3, 224, 224)}),
    "gpt2": ("_export_gpt2", {"input_ids": (1, 128)}),  # causal mask, logits over the 50,257 tokens
    "bert_base": ("_export_bert", {"input_ids": (1, 128), "attention_mask": (1, 128)}),
    # Whisper-tiny's audio encoder: a conv1d stem over 3,000 mel frames, attention over 1,500 positions
    "whisper_tiny_encoder": ("_export_whisper_encoder", {"input_features": (1, 80, 3000)}),
}

# Decoders with their key/value cache as inputs and outputs, named as Hugging Face optimum names them, for the
# generation loop (server/runtime/generation): name -> (export function's name, input name -> shape of one
# decode step at batch 1, after 127 positions). Kept out of TRANSFORMERS, every one of which bench_table.py's
# compile benchmark must cover: a decoder is served by the generation loop, not compiled per bucket.
DECODERS: dict[str, tuple[str, dict[str, tuple[int, ...]]]] = {
    "gpt2_kv": (
        "_export_gpt2_kv",
        {
            "input_ids": (1, 1),
            "attention_mask": (1, 128),
            "position_ids": (1, 1),
            **{f"past_key_values.{i}.{kind}": (1, 12, 127, 64) for i in range(12) for kind in ("key", "value")},
        },
    ),
}

# Every model of the zoo: name -> input name -> shape at batch 1.
ZOO_MODELS: dict[str, dict[str, tuple[int, ...]]] = {
    **{name: {"x": shape} for name, (_, _, shape) in ARCHITECTURES.items()},
    **{name: inputs for name, (_, inputs) in TRANSFORMERS.items()},
    **{name: inputs for name, (_, inputs) in DECODERS.items()},
}


def zoo_path(name: str) -> Path:
    return ZOO / f"{name}.onnx"


# Quantized variants: name -> (the zoo model it quantizes, how). Made by ONNX Runtime's own quantizer in the
# main environment (``quantized``; the zoo's torch environment has no onnxruntime), as users make theirs:
# ResNet-50 and BERT-base statically in QDQ form (per-channel int8 weights, int8 activations, calibrated on 4
# random inputs: images, or token ids with a full attention mask), BERT-base dynamically too (int8 weights,
# uint8 activations quantized per request).
QUANTIZED: dict[str, tuple[str, str]] = {
    "resnet50_int8_qdq": ("resnet50", "static"),
    "bert_base_int8_dynamic": ("bert_base", "dynamic"),
    "bert_base_int8_qdq": ("bert_base", "static"),
}


def quantized(name: str) -> Path:
    """The quantized zoo model ``name`` (:data:`QUANTIZED`), made from its fp32 export once, atomically."""
    path = zoo_path(name)
    if path.is_file():
        return path
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static

    source, how = QUANTIZED[name]
    partial = path.with_suffix(".part.onnx")
    if how == "dynamic":
        quantize_dynamic(str(zoo_path(source)), str(partial))
    else:
        inputs = ZOO_MODELS[source]

        def sample(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
            if name == "input_ids":
                return rng.integers(0, 1000, shape).astype(np.int64)
            if name == "attention_mask":
                return np.ones(shape, np.int64)
            return rng.standard_normal(shape).astype(np.float32)

        class Samples(CalibrationDataReader):
            def __init__(self) -> None:
                rng = np.random.default_rng(0)
                self.batches = iter([{n: sample(rng, n, shape) for n, shape in inputs.items()} for _ in range(4)])

            def get_next(self) -> dict | None:
                return next(self.batches, None)

        quantize_static(str(zoo_path(source)), str(partial), Samples(), quant_format=QuantFormat.QDQ, per_channel=True)
    partial.replace(path)
    return path


def export(name: str) -> Path:
    """Exports ``name`` into the cache, atomically."""
    path = zoo_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    if name in TRANSFORMERS or name in DECODERS:
        globals()[{**TRANSFORMERS, **DECODERS}[name][0]](partial)
    else:
        _export_convnet(name, partial)
    partial.replace(path)
    return path


def _export_convnet(name: str, partial: Path) -> None:
    import torch

    model, shape = torch_module(name)
    _export_torchscript(torch, model, shape, partial)


def torch_module(name: str):
    """The torch module a torchvision model of the zoo (a convnet or ViT-B/16) is exported from, the same
    weights every time, and its input's shape at batch 1: the peer a GPU bench runs beside the export."""
    import torch

    if name == "vit_b_16":
        model = _torchvision_model("vit_b_16", {})
        # torchvision starts the classifier at zero: every image would answer zeros, and a check against
        # any reference would pass whatever the kernels computed.
        with torch.no_grad():
            torch.nn.init.normal_(model.heads.head.weight, std=0.02)
            torch.nn.init.uniform_(model.heads.head.bias, -0.1, 0.1)
        return model, TRANSFORMERS[name][1]["x"]
    builder, kwargs, shape = ARCHITECTURES[name]
    model = _torchvision_model(builder, kwargs)
    calibrate(torch, model, shape)
    if builder.startswith("segmentation."):
        model = _first_output(torch, model)
    return model, shape


def _torchvision_model(builder: str, kwargs: dict):
    import torch
    import torchvision

    torch.manual_seed(0)
    module = torchvision.models
    for part in builder.split("."):
        module = getattr(module, part)
    return module(weights=None, **kwargs).eval()


def _export_torchscript(
    torch, model, shape: tuple[int, ...], partial: Path, names: tuple[str, str] = ("x", "y")
) -> None:
    torch.onnx.export(
        model,
        (torch.randn(*shape),),
        str(partial),
        input_names=[names[0]],
        output_names=[names[1]],
        dynamic_axes={names[0]: {0: "batch"}, names[1]: {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )


def _export_vit(partial: Path) -> None:
    import torch

    _export_torchscript(torch, *torch_module("vit_b_16"), partial)


def _export_gpt2(partial: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(use_cache=False)  # GPT-2 small: 12 layers, hidden 768, 12 heads
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

    _export_dynamo(torch, Logits().eval(), "gpt2", ["logits"], partial)


def _export_gpt2_kv(partial: Path) -> None:
    """GPT-2 small (the weights of ``gpt2``'s export) with its cache: ``input_ids``, ``attention_mask`` [batch,
    past + new] and ``position_ids`` in, and per layer ``past_key_values.{i}.key`` / ``.value`` [batch, 12, past,
    64]; ``logits`` and ``present.{i}.key`` / ``.value`` [batch, 12, past + new, 64] out. ``past`` may be 0: a
    prefill is the same graph with an empty cache."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config()  # use_cache draws no weights: the same seed gives gpt2's
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()

    class WithCache(torch.nn.Module):
        """The cache as flat tensors, layer by layer, key then value: torch.export takes tensors, and
        transformers takes a Cache object."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, past):
            pairs = list(zip(past[0::2], past[1::2], strict=True))
            cache = transformers.DynamicCache(ddp_cache_data=pairs, config=config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True)  # fmt: skip
            return out.logits, *(tensor for layer in out.cache.layers for tensor in (layer.keys, layer.values))

    cache_names = [f"{i}.{kind}" for i in range(config.n_layer) for kind in ("key", "value")]
    batch, new = torch.export.Dim("batch", max=64), torch.export.Dim("new", max=config.n_positions)
    # min=0: the prefill's empty cache. The mask's axis (past + new) has a Dim of its own: a Dim cannot be
    # the sum of two others.
    past = torch.export.Dim("past", min=0, max=config.n_positions)
    total = torch.export.Dim("total", max=config.n_positions)
    rows, past_length, new_length = 2, 3, 2  # examples off 0 and 1, which torch.export would specialise
    heads, head_dim = config.n_head, config.n_embd // config.n_head
    examples = (
        torch.randint(0, config.vocab_size, (rows, new_length)),
        torch.ones(rows, past_length + new_length, dtype=torch.int64),
        torch.arange(past_length, past_length + new_length).repeat(rows, 1),
        [torch.randn(rows, heads, past_length, head_dim) for _ in cache_names],
    )
    torch.onnx.export(
        WithCache().eval(),
        examples,
        str(partial),
        input_names=["input_ids", "attention_mask", "position_ids", *(f"past_key_values.{n}" for n in cache_names)],
        output_names=["logits", *(f"present.{n}" for n in cache_names)],
        dynamic_shapes=(
            {0: batch, 1: new},
            {0: batch, 1: total},
            {0: batch, 1: new},
            [{0: batch, 2: past}] * len(cache_names),
        ),
        opset_version=18,
        dynamo=True,
        external_data=False,
    )


def _export_bert(partial: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig()  # BERT-base: 12 layers, hidden 768, 12 heads
    model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    _export_dynamo(torch, Hidden().eval(), "bert_base", ["hidden"], partial)


def _export_whisper_encoder(partial: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.WhisperConfig(  # whisper-tiny: 4 encoder layers, d_model 384, 6 heads
        d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536, num_mel_bins=80
    )
    encoder = transformers.WhisperModel(config).get_encoder().eval()
    encoder.config._attn_implementation = "eager"

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_features):
            return self.encoder(input_features).last_hidden_state

    shape = TRANSFORMERS["whisper_tiny_encoder"][1]["input_features"]
    _export_torchscript(torch, Encoder().eval(), shape, partial, names=("input_features", "hidden"))


def _export_dynamo(torch, model, name: str, outputs: list[str], partial: Path) -> None:
    """Token-id inputs with symbolic batch and sequence axes, weights inside the file."""
    inputs = TRANSFORMERS[name][1]
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", min=2, max=1024)
    examples = tuple(torch.randint(1, 8, shape) for shape in inputs.values())
    torch.onnx.export(
        model,
        examples,
        str(partial),
        input_names=list(inputs),
        output_names=outputs,
        dynamic_shapes={input_name: {0: batch, 1: seq} for input_name in inputs},
        opset_version=18,
        dynamo=True,
        external_data=False,
    )


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
    parser.add_argument("--only", nargs="*", choices=sorted(ZOO_MODELS), help="export these only")
    parser.add_argument("--list", action="store_true", help="print the zoo as JSON lines and export nothing")
    parser.add_argument("--force", action="store_true", help="export again what the cache holds")
    args = parser.parse_args()
    for name in args.only or sorted(ZOO_MODELS):
        path = zoo_path(name)
        if not args.list and (args.force or not path.is_file()):
            export(name)
        line = {"model": name, "path": str(path.relative_to(REPO)), "inputs": ZOO_MODELS[name]}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
