"""Strategies (plans): one sharding option per op node and a home placement per parameter and
input (base), how Duplex's micro-batches split each tensor (microbatch), the fixed strategies
a user would pick instead (fixed), and how a strategy reads in a report (describe). Plan files
are in hidup.planning.planfile; choosing a plan is hidup.planning.select."""
from hidup.strategy.base import (NoMicroBatches, Strategy, Unreachable, conversion,
                                 conversion_cost, dp_axes, fitting_options, propagate,
                                 splits_evenly)
from hidup.strategy.describe import describe, mesh_option, op_style, summarize, uncovered
from hidup.strategy.fixed import (ACROSS, FIXED, data_parallel, expert_parallel, fixed_strategies,
                                  fixed_strategy, fully_sharded, megatron, random_strategy,
                                  sharded_storage, stored_across)
from hidup.strategy.mesh import AXES, Mesh
from hidup.strategy.microbatch import microbatch_split
from hidup.strategy.recompute import (describe_recompute, first_layers, layers, parse_recompute,
                                      recomputing, selective_part)

__all__ = ["ACROSS", "AXES", "FIXED", "Mesh", "NoMicroBatches", "Strategy", "Unreachable", "conversion",
           "conversion_cost", "data_parallel", "dp_axes", "describe", "describe_recompute",
           "expert_parallel", "first_layers", "fitting_options", "fixed_strategies",
           "fixed_strategy", "fully_sharded", "layers", "megatron", "mesh_option",
           "microbatch_split", "op_style", "parse_recompute", "propagate", "random_strategy",
           "recomputing", "selective_part", "sharded_storage", "splits_evenly", "stored_across",
           "summarize", "uncovered"]
