"""Activation checkpointing as a plan decision: the layers whose activations are not kept from
the forward for the backward but recomputed in it (Strategy.recompute).

A layer is a repeated block of the model, a child of an nn.ModuleList or nn.Sequential
(Node.layer: 'blocks.3'). In a recomputed layer every op the backward differentiates runs twice:
in the forward without keeping anything for the backward, and again right before the layer's
backward for the same micro-batch, whose values the backward then reads (torch.utils.checkpoint
per layer). What the layer reads from outside it (its input, the weights) is kept, as a checkpoint
keeps its inputs. Left out of the recomputation, their outputs kept: random ops (dropout: the
recomputed mask would differ), ops computed once per step rather than per micro-batch, and ops
that read the micro-batches joined (hidup.program.recompute).

Selectively (Strategy.selective), a layer keeps the outputs of its compute-heavy ops (at least
16 FLOPs per output element) and recomputes the rest: the backward of such an op whose derivative
reads only its inputs (a matmul) differentiates it again from its recomputed inputs, and its
forward, whose output nothing reads, is dropped from the compiled step; one whose derivative reads
its output too (attention) runs once, keeping what its backward reads."""
from __future__ import annotations

from dataclasses import replace

from hidup.graph.capture import Graph
from hidup.strategy.base import Strategy


def layers(graph: Graph) -> list[str]:
    """The model's layers in forward order (Node.layer of its ops)."""
    return list(dict.fromkeys(n.layer for n in graph.ops if n.layer))


def recomputing(graph: Graph, strategy: Strategy, chosen, selective: bool = False) -> Strategy:
    """`strategy` with the activations of the layers `chosen` recomputed in the backward (and
    of no others): whole, or `selective`ly (the compute-heavy ops' outputs kept). An unknown
    layer is a one-line ValueError that names the model's."""
    known = layers(graph)
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        have = f"its layers are {_span(known)}" if known else \
            "it has none (no op runs inside a child of an nn.ModuleList or nn.Sequential)"
        raise ValueError(f"recompute: {', '.join(unknown[:3])} is not a layer of this model; "
                         f"{have}; give layers it has, 'all' or a count")
    chosen = frozenset(chosen)
    return replace(strategy, recompute=frozenset() if selective else chosen,
                   selective=chosen if selective else frozenset())


def parse_recompute(text: str, graph: Graph) -> frozenset[str]:
    """A --recompute value: 'none', 'all', N (the first N layers) or layer names joined by
    commas (after 'selective:' the same, recomputed selectively: selective_part)."""
    known = layers(graph)
    text = selective_part(text)[1].strip()
    if text in ("", "none"):
        return frozenset()
    if text == "all":
        return frozenset(known)
    if text.isdigit():
        if int(text) > len(known):
            raise ValueError(f"recompute: {text} layers, the model has {len(known)}; give at "
                             f"most {len(known)}, 'all' or 'none'")
        return frozenset(known[:int(text)])
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def selective_part(text: str) -> tuple[bool, str]:
    """'selective:all' -> (True, 'all'); 'selective' alone is every layer; else (False, text)."""
    text = text.strip()
    if text == "selective":
        return True, "all"
    if text.startswith("selective:"):
        return True, text.removeprefix("selective:")
    return False, text


def first_layers(graph: Graph, n: int) -> frozenset[str]:
    """The model's first n layers (whose activations are kept longest: they are freed last)."""
    return frozenset(layers(graph)[:n])


def describe_recompute(graph: Graph, strategy: Strategy) -> str:
    """'; activations of 4 of 8 layers recomputed in the backward (blocks.0 .. blocks.3)', or ''."""
    known, text = layers(graph), ""
    whole = [name for name in known if name in strategy.recompute]
    some = [name for name in known if name in strategy.selective]
    if whole:
        text += f"; activations of {len(whole)} of {len(known)} layers recomputed in the " \
                f"backward ({_span(whole)})"
    if some:
        text += f"; {len(some)} of {len(known)} layers recomputed selectively, their matmuls' " \
                f"and attention's outputs kept ({_span(some)})"
    return text


def _span(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]}"


def recomputable_share(graph: Graph, recompute: frozenset[str] | None) -> dict[str, float]:
    """Per op whose output may be recomputed in the backward (read only inside its layer, a
    layer the search may recompute: any where `recompute` is None, else those named), the share
    of its output the programme counts as held: 1 / layers, as if every layer were recomputed and
    one layer's activations were held at a time (the ranking lowers each plan and checks its
    memory, recomputing only what it needs: Ranking.recompute_deferred)."""
    names = {n.layer for n in graph.ops if n.layer}
    if recompute is not None:
        names &= recompute
    if not names:
        return {}
    inside: dict[str, bool] = {}
    for node in graph.ops:
        for t in node.inputs:
            inside[t] = inside.get(t, True) and node.layer == graph.node(t).layer
    return {n.name: 1 / len(names) for n in graph.ops
            if n.layer in names and inside.get(n.name, False) and n.name != graph.loss}
