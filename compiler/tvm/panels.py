"""A matmul's weight packed into column panels once per model version, not streamed K rows apart.

The contraction rule tiles ``x @ w`` by panels of ``nr`` output columns and, per panel, reads the
``K x nr`` slice of ``w``: in ``w``'s own (K, N) layout that slice is 64 bytes every N * 4, one page
apart for N >= 1024, which the hardware prefetchers do not follow. Warm in the cache it does not
matter; in a model, whose weights outgrow the L3 between one call of a kernel and the next, each
line was a miss: ConvNeXt-Tiny's 768 x 3072 MLP ran 1.82 ms with its weights flushed against 1.52
warm. ONNX Runtime's MLAS prepacks a constant B the same way for its GEMM.

Here ``w`` becomes ``(N / L, K, L)`` panels (L: two vectors, the rule's column tile; a last panel of
fewer columns is padded with zeros), computed from the weights alone, so ``LiftTransformParams``
moves it into the weight transform; the matmul computes per panel, each one contiguous run, and its
product is cut back to N columns. A classifier's 1 x 1280 x 1000 product, which ran 0.25-0.29 ms
in MobileNetV3-Large against ONNX Runtime's 0.13-0.17 on weights 1000 floats apart, ran 0.11 against
0.11 (AMD EPYC Zen 3, AVX2).

Runs in the compile child only (imports TVM).
"""

from __future__ import annotations

import tvm
from tvm import relax, te


def _static(expr) -> list[int] | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    dims = list(shape.values) if shape is not None and hasattr(shape, "values") else None
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def weight_vars(func: relax.Function) -> set:
    """The function's weight parameters (those after ``num_input``) and every var bound to a value
    computed from them (or constants) alone: what ``LiftTransformParams`` lifts, or ``FoldConstant`` folds."""
    num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    weights = set(func.params[num_input:])
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            free = relax.analysis.free_vars(binding.value)
            if all(var in weights for var in free):
                weights.add(binding.var)
    return weights


def _panel_matmul(x: te.Tensor, panels: te.Tensor, columns: int) -> te.Tensor:
    # The product per panel (the rule vectorizes a panel's columns, its innermost axis), then copied out to
    # (..., N): the copy inlines into the epilogue, which reads the panel's columns from the tile.
    *lead, rows, depth = (int(d) for d in x.shape)
    count, _, width = (int(d) for d in panels.shape)
    k = te.reduce_axis((0, depth), name="k")
    product = te.compute(
        (*lead, rows, count, width),
        lambda *i: te.sum(x[(*i[:-2], k)] * panels[i[-2], k, i[-1]], axis=k),
        name="matmul",
    )
    return te.compute(
        (*lead, rows, columns), lambda *i: product[(*i[:-1], i[-1] // width, i[-1] % width)], name="columns"
    )


@relax.expr_functor.mutator
class _PanelMatmuls(relax.PyExprMutator):
    def __init__(self, mod: tvm.ir.IRModule, weights: set, width: int) -> None:
        super().__init__(mod)
        self.weights = weights
        self.width = width
        self.packed = 0
        self._panels: list[tuple[relax.Expr, relax.Var]] = []  # (weight, its panels): one copy per weight

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if getattr(call.op, "name", "") != "relax.matmul":
            return call
        if not (isinstance(call.args[1], tvm.ir.expr.Constant) or call.args[1] in self.weights):
            return call  # computed per request: packing it would cost every request a pass over it
        data, weight = _static(call.args[0]), _static(call.args[1])
        if data is None or weight is None or len(weight) != 2 or len(data) < 2 or call.ty.dtype != "float32":
            return call
        if call.args[0].ty.dtype != "float32" or call.args[1].ty.dtype != "float32":
            return call
        columns = weight[1]
        count = -(-columns // self.width)
        if count == 1:
            return call
        self.packed += 1
        return self.builder_.call_te(_panel_matmul, call.args[0], self._packed(call.args[1], count), columns,
                                     primfunc_name_hint="matmul")  # fmt: skip

    def _packed(self, weight: relax.Expr, count: int) -> relax.Var:
        """``weight``'s panels, emitted once however many matmuls read it (a tied or shared weight)."""
        found = next((panels for known, panels in self._panels if known.same_as(weight)), None)
        if found is not None:
            return found
        depth, columns = _static(weight)
        padded = weight
        if count * self.width != columns:  # the last panel's columns past N are zeros, never copied out
            padded = relax.op.nn.pad(weight, [0, 0, 0, count * self.width - columns])
        panels = self.builder_.emit(
            relax.op.permute_dims(relax.op.reshape(padded, [depth, count, self.width]), [1, 0, 2])
        )
        self._panels.append((weight, panels))
        return panels


def panel_matmuls(mod: tvm.ir.IRModule, lanes: int) -> tuple[tvm.ir.IRModule, int]:
    """``mod`` with every float32 matmul by a static 2-D weight reading it from column panels of two
    vectors (``lanes`` floats each), and how many it packed."""
    names = [g_var.name_hint for g_var in mod.get_global_vars()]
    if "main" not in names:
        return mod, 0
    mutator = _PanelMatmuls(mod, weight_vars(mod["main"]), 2 * lanes)
    g_var = mod.get_global_var("main")
    mutator.builder_.update_func(g_var, mutator.visit_expr(mod["main"]))
    return mutator.builder_.get(), mutator.packed
