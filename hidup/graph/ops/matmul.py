"""Matmul-like ops: one einsum-driven option generator for linear, mm, bmm, matmul, addmm, einsum,
and scaled-dot-product attention (sharded by batch and heads)."""
from __future__ import annotations

import string

import torch

from hidup.graph.nodes import Ref, fill
from hidup.graph.ops.registry import arg, default_local, register, register_local
from hidup.graph.placement import P, R, Shard, ShardingOption

aten = torch.ops.aten


def einsum_options(in_specs: list[str], out_spec: str, in_shapes) -> list[ShardingOption]:
    """All-replicated, plus one option per index letter: split every tensor that has the letter along
    it; the output is Shard on the letter's position, or Partial when the letter is contracted.
    Letters of size 1 are not split. An empty spec ('') stands for an input that is not a tensor."""
    sizes = {c: s for spec, shape in zip(in_specs, in_shapes) for c, s in zip(spec, shape)}
    opts = [ShardingOption((R,) * len(in_specs), R)]
    for letter in dict.fromkeys("".join(in_specs)):
        if sizes[letter] <= 1:
            continue
        ins = tuple(Shard(spec.index(letter)) if letter in spec else R for spec in in_specs)
        out = Shard(out_spec.index(letter)) if letter in out_spec else P
        opts.append(ShardingOption(ins, out))
    return opts


def _batch_letters(n: int) -> str:
    return string.ascii_lowercase[:n]


@register(aten.linear.default)
def linear(node, ins):
    batch = _batch_letters(len(ins[0].shape) - 1)
    specs = [batch + "K", "NK"] + (["N"] if len(ins) == 3 else [])
    return einsum_options(specs, batch + "N", [m.shape for m in ins])


@register(aten.mm.default)
def mm(node, ins):
    return einsum_options(["MK", "KN"], "MN", [m.shape for m in ins])


@register(aten.bmm.default)
def bmm(node, ins):
    return einsum_options(["BMK", "BKN"], "BMN", [m.shape for m in ins])


@register(aten.addmm.default)
def addmm(node, ins):
    bias = "MN"[2 - len(ins[0].shape):] if ins[0].shape and ins[0].shape[0] != 1 else "N"
    bias = bias if len(ins[0].shape) else ""
    return einsum_options([bias, "MK", "KN"], "MN", [m.shape for m in ins])


@register(aten.matmul.default)
def matmul(node, ins):
    a, b = ins[0].shape, ins[1].shape
    n = max(len(a), len(b)) - 2
    letters = _batch_letters(max(n, 0))
    def spec(shape, other, core):
        nb, no = len(shape) - len(core), max(len(other) - 2, 0)
        out = ""
        for i in range(nb):
            j = i + (n - nb)
            oi = j - (n - no)
            broadcast = shape[i] == 1 and 0 <= oi < no and other[oi] != 1
            out += "wxyz"[j % 4] if broadcast else letters[j]
        return out + core
    a_spec = spec(a, b, "MK"[2 - min(len(a), 2):])
    b_spec = spec(b, a, "KN"[: min(len(b), 2)])
    out_spec = letters + ("M" if len(a) >= 2 else "") + ("N" if len(b) >= 2 else "")
    return einsum_options([a_spec, b_spec], out_spec, [a, b])


@register(aten.einsum.default)
def einsum(node, ins):
    equation = node.args[0].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise ValueError(f"einsum equation {equation!r}: write it with '->' and without '...'")
    lhs, out = equation.split("->")
    return einsum_options(lhs.split(","), out, [m.shape for m in ins])


@register_local([aten.linear.default, aten.addmm.default])
def bias_once(node, option, ctx):
    """A Partial output gets the bias on one rank only, so that the sum over ranks adds it once."""
    run = default_local(node, option, ctx)
    if ctx.root:
        return run
    if node.op == "aten.linear.default" and len(node.inputs) == 3:
        return lambda t: aten.linear.default(t[0], t[1])
    if node.op == "aten.addmm.default":
        return lambda t: aten.mm.default(t[1], t[2]) * fill(node.kwargs.get("alpha", 1), t)
    return run


@register(aten.scaled_dot_product_attention.default)
def attention(node, ins):
    """Split batch or head dims (q, k, v alike); the query sequence too when there is no mask."""
    q = ins[0].shape
    batch = _batch_letters(len(q) - 2)
    specs = [batch + "QE", batch + "KE", batch + "KV"]
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, Ref):
        mshape = ins[3].shape
        full = batch + "QK"
        specs.append("".join(c if s != 1 else "_" for c, s in zip(full[len(full) - len(mshape):], mshape)))
    opts = einsum_options(specs, batch + "QV", [m.shape for m in ins])
    causal = arg(node, 5, "is_causal", False)
    keep = set(batch) | ({"Q"} if not causal and not isinstance(mask, Ref) else set())
    return [o for o in opts if o.output == R or (isinstance(o.output, Shard)
                                                  and (batch + "QV")[o.output.dim] in keep)]
