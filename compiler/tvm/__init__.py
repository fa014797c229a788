"""TVM's compile side: the only package that imports the ONNX frontend, the
Relax pipeline, the schedule rules, MetaSchedule and onnxsim. Its modules run
in the compile child; importing this package itself loads no TVM.

The two constants below are the pipeline's identity in every artifact key:
a kernel built by a different pipeline is a different artifact; so is one
scheduled by another release of the shipped tuning database.
"""

import functools
import hashlib
from pathlib import Path

SHIPPED_TUNING_DIR = Path(__file__).resolve().parents[1] / "tuning_db"
"""The tuning database shipped with the compiler: one file per vector ISA and core count."""

# The named stages of pipeline.py, in order.
PIPELINE = "layout+fuse+tuning-records+default-schedules"

# Bump when jitserve's own build steps (prepare.py, pipeline.py, schedules/) change the code they generate
# (6: weights are parameters, prepared once per model version; 8: upsampling conv2d_transpose as phase
# GEMMs, small-map 1x1 convs as matmuls over the flattened map; 9: symbolic extents scheduled, padded-width
# convs, stepped dynamic dims, symbolic maps flattened; 10: a conv whose padded input is read with a
# stride gets its pad computed up front, where it was left to the row-reduction rule; 11: convs channel-blocked
# on the CPU, weight transforms lifted out of the kernel; 14: pads and copies of 64K elements run in
# parallel, a grouped conv pads per output row; 15: channel-blocked convs of 1M multiply-adds run in parallel;
# 16: the RGB first conv reads its input in NCHW, a matmul over a batch of rows runs over all of them, a
# blocked model's matmul reads its weight from column panels, layout transforms fuse as gathers; 17: the
# logistic is a rational function, NaN is tested on the bits;
# 18: a blocked 1x1 conv's map is flattened where its width gives a poor register tile; 19: a blocked pad
# computed up front runs a row per parallel iteration; 20: tanh is a rational function, x ** 2 and x ** 3 are
# products; 21: CUDA source compiled without fast math, a dlight rule that fails on a kernel declines it;
# 22: a strided 1x1 conv over a blocked map reads a subsampled copy; 23: a bilinear resize in two passes;
# 24: a tile's accumulators on the stack; 25: a blocked conv's tile fits the registers, a padded conv is
# computed on a few more columns where they give a better tile; 26: AVX-512 tiles of at most 15
# accumulators, on the stack; 27: a blocked conv computes its exact width, the tile's last one partial and
# peeled, where the reduction is chunked; 28: a padded or 1x1 contraction's register tile runs along the map
# rather than across the batch where the map has 4 columns; 29: a grouped stride-1 conv's blocks of a group share a
# register tile; 30: chained polynomial math kept in stages rather than copied at every load; 31: a
# squeeze-excitation gate computed once per channel, its broadcast multiply a parallel stage; 32: an
# unblocked model's matmul whose columns fill no whole vectors reads its weight from panels; 33: every
# matmul by a static weight reads it from panels, an unblocked model's too; 34: channels padded to
# whole blocks, every conv of a blocked model blocked; a strided conv of narrow groups runs block-wide;
# 35: the lifted weight transform split into one function per transformed weight, each with its digest;
# 36: a pool over a map shorter than its window computed as ONNX Runtime does, one output, not none; a
# per-channel pad bounded by min and max computed up front; dims TVM cannot prove equal checked at run time;
# the rules' choices read through knobs, which tuning turns; a long vector axis only half vectors divide
# padded to whole ones; a conv1d runs as a conv2d one row high; 37: a softmax row no whole vector divides
# computed in whole vectors, then its tail; a quantized matmul by a constant int8 weight on packed int16
# panels, tensorized into the CPU's int16 pair products; a whole tensor reduced to one value in vector partials;
# 38: a QDQ conv over int8 operands computed as a channel-blocked int16 conv tensorized into int16 pair products,
# a per-tensor quantize and dequantize as the elementwise ops they are; integer products on VNNI's vpdpwssd
# and vpdpbusd where the target has them, bytes by any int8 weight there); 39: a QDQ matmul by a constant int8
# weight computed on panels as a MatMulInteger, its int8 activation shifted to uint8; a MatMulInteger in byte
# pairs on any int8 weight, summed as ONNX Runtime's own kernels sum them; 40: a quantized model's int8
# weights are kernel parameters, their panels packed by the weight transform; a quantized embedding looked up
# in int8, then dequantized; 41: a quantized model's scalar scales and zero points are 0-d tensor operands, so
# its layers share kernels; 42: a bf16 matmul's rows zero-padded to whole register tiles.
COMPILER_VERSION = "42"


@functools.cache
def shipped_tuning_digest() -> str:
    """sha256 of the shipped tuning database's files (names and contents); empty where it holds none."""
    files = sorted(SHIPPED_TUNING_DIR.glob("*.json.gz")) if SHIPPED_TUNING_DIR.is_dir() else []
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16] if files else ""
