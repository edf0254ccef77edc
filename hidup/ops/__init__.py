"""Sharding rules, one module per op family; importing this package registers them all."""
from hidup.ops import embedding, loss, matmul, pointwise, reduction, shape  # noqa: F401  (registers)
from hidup.ops.registry import (LocalContext, NoRuleError, local_callable, options,  # noqa: F401
                                register, register_local)
