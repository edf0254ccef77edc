"""Sharding rules, one module per op family; importing this package registers them all."""
from hidup.ops import (conv, embedding, gating, loss, matmul, pointwise,  # noqa: F401 (registers)
                       reduction, shape)
from hidup.ops.registry import (LocalContext, NoRuleError, local_callable, options,  # noqa: F401
                                register, register_local)
