"""FLOPs of one op call from its shapes. Matmuls, convolutions and attention's two matmuls by
torch.utils.flop_counter's formulas (the matmul ones written out: `linear`, `matmul` and
`einsum` are composites the counter sees as the mm / bmm they decompose to; a grouped matmul
as the rows' matmuls with their experts), attention's softmax as five passes over the scores;
any other op as one FLOP per element of its largest tensor.
Backward: the counter's formula for convolutions; twice the forward for the rest (a matmul's
input and weight gradients are two matmuls; an element-wise op's backward is about two passes).
(The counter's attention backward, 2.5 x its forward, is not used: the shipped profiles were
fitted from traces with 2 x.)"""
from __future__ import annotations

import math

from torch.utils.flop_counter import conv_backward_flop, conv_flop_count, sdpa_flop_count

_MATMUL = {"aten.linear.default", "aten.matmul.default", "aten.mm.default", "aten.bmm.default",
           "aten.addmm.default", "aten.baddbmm.default"}
_CONV = {f"aten.{name}.{overload}" for name in ("conv1d", "conv2d", "conv3d")
         for overload in ("default", "padding")} | {"aten.convolution.default",
                                                    "aten._convolution.default"}
_TRANSPOSED = {f"aten.conv_transpose{d}d.input" for d in (1, 2, 3)}
_SDPA = "aten.scaled_dot_product_attention.default"
# a grouped matmul (routed experts): PyTorch's, and the same op a library registers for the CPU
GROUPED_MM = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


def library_op(op: str) -> bool:
    """Whether a library kernel (cuBLAS, cuDNN, fused attention) runs the op, priced by its FLOPs
    above: Inductor calls such an op as it is and fuses no other op into it
    (hidup.planning.fusion)."""
    return op in _MATMUL or op in _CONV or op in _TRANSPOSED or op == _SDPA or \
        op in GROUPED_MM or op == "aten.einsum.default"


def forward_flops(op: str, in_shapes, out_shape, args=(), sent: bool = False) -> float:
    """An op's forward FLOPs on inputs of these (local) shapes; `sent`: a per-token region's
    rows sent to their experts' ranks (hidup.graph.ops.gating.exchanges)."""
    if op == "hidup.tokens":  # a per-token region (hidup.graph.tokens): its ops' on these rows
        return args[0].flops_on(in_shapes, sent)
    out = math.prod(out_shape)
    if op in _MATMUL:
        k = in_shapes[0][-1] if op != "aten.addmm.default" else in_shapes[1][-1]
        return 2.0 * out * k
    if op == "aten.einsum.default":
        return 2.0 * _einsum_points(args[0], in_shapes)
    if op in _CONV or op in _TRANSPOSED:
        return float(conv_flop_count(list(in_shapes[0]), list(in_shapes[1]), list(out_shape),
                                     _transposed(op, args)))
    if op == _SDPA:  # the two matmuls (the counter's formula) and the softmax's passes
        *batch, s_q, _ = in_shapes[0]
        scores = math.prod(batch) * s_q * in_shapes[1][-2]
        return float(sdpa_flop_count(*(_heads(s) for s in in_shapes[:3]))) + 5.0 * scores
    if op in GROUPED_MM and len(in_shapes) == 3 and len(in_shapes[1]) == 3:
        # each row times one expert's weight; a rank holding some of the experts (in_shapes[1])
        # of all (offs, in_shapes[2]) computes their share of the rows
        rows, k = in_shapes[0]
        return 2.0 * rows * k * out_shape[-1] * in_shapes[1][0] / max(in_shapes[2][0], 1)
    if op == "aten.embedding.default":
        return 0.0
    return float(max(out, max((math.prod(s) for s in in_shapes), default=0)))


def backward_flops(op: str, fwd: float, in_shapes=(), out_shape=(), args=()) -> float:
    """The backward's FLOPs (both input and weight gradients) of an op whose forward took
    `fwd`, by the counter's formulas where it has them (shapes given), else 2 x fwd."""
    if op in _CONV and in_shapes:
        x, w = list(in_shapes[0]), list(in_shapes[1])  # and their gradients' shapes
        return float(conv_backward_flop(list(out_shape), x, w, None, None, None, None,
                                        _transposed(op, args), None, None, [True, True, False],
                                        out_val=(x, w, None)))
    return 2.0 * fwd


def _transposed(op: str, args) -> bool:
    if op in _TRANSPOSED:
        return True
    generic = op in ("aten.convolution.default", "aten._convolution.default")
    return generic and len(args) > 6 and bool(args[6])


def _heads(shape) -> list[int]:
    """An attention operand as (batch, heads, sequence, dim): leading dims merged, or a
    batch of one head."""
    shape = [1] * (4 - len(shape)) + list(shape)
    return [math.prod(shape[:-3]), *shape[-3:]]


def _einsum_points(equation: str, in_shapes) -> int:
    lhs = equation.replace(" ", "").split("->")[0]
    sizes: dict[str, int] = {}
    for spec, shape in zip(lhs.split(","), in_shapes):
        for letter, size in zip(spec, shape):
            sizes[letter] = size
    return math.prod(sizes.values())
