"""Sharding rules, one module per op family; importing this package registers them all."""
from hidup.graph.ops import (  # noqa: F401 (importing them registers their rules)
    conv, dispatch, embedding, factory, gating, grouped, loss, matmul, pointwise, reduction, shape)
from hidup.graph.ops.registry import (  # noqa: F401
    LocalContext, inner_collectives, local_callable, node_options, options, register, register_local, replicated_ops,
    runs_inner, source)
