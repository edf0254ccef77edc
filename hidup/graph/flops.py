"""FLOPs of one op call from its shapes (matmul-like ops exactly, others as one FLOP per element)."""
from __future__ import annotations

import math

_MATMUL = {"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
           "aten.addmm.default", "aten.baddbmm.default"}


def forward_flops(op: str, in_shapes, out_shape, args=()) -> float:
    out = math.prod(out_shape)
    if op in _MATMUL:
        k = in_shapes[0][-1] if op != "aten.addmm.default" else in_shapes[1][-1]
        return 2.0 * out * k
    if op == "aten.einsum.default":
        return 2.0 * _einsum_points(args[0], in_shapes)
    if op == "aten.scaled_dot_product_attention.default":
        *batch, s_q, d = in_shapes[0]
        s_k, d_v = in_shapes[1][-2], in_shapes[2][-1]
        b = math.prod(batch)
        return 2.0 * b * s_q * s_k * (d + d_v) + 5.0 * b * s_q * s_k
    if op == "aten.embedding.default":
        return 0.0
    return float(max(out, max((math.prod(s) for s in in_shapes), default=0)))


def backward_flops(op: str, fwd: float) -> float:
    """Backward of a matmul costs two matmuls (input and weight grads); element-wise about two passes."""
    return 2.0 * fwd


def _einsum_points(equation: str, in_shapes) -> int:
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int] = {}
    for spec, shape in zip(lhs.split(","), in_shapes):
        for letter, size in zip(spec, shape):
            sizes[letter] = size
    return math.prod(sizes.values())
