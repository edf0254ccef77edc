"""The Program: one training step of one rank as ordered tasks (compute, conversions, waits),
each tagged with its micro-batch. `tasks` is the data model, `lowering` builds a Program from a
strategy (`lower`); the executor (hidup.runtime) runs it, the simulator times it."""
from hidup.program.lowering import Lowering, lower
from hidup.program.tasks import (BUCKET_BYTES, COLLECTIVES, FIRST_BUCKET_BYTES, HOST_MODES, MODES,
                                 OPTIMIZERS, Compute, Convert, LoweringError, OptimizerCost,
                                 Program, Task, Wait, gkey, kernel_tasks, local_shape,
                                 optimizer_cost, task_label, tensor_nbytes, tensor_shape, vkey)

__all__ = ["BUCKET_BYTES", "COLLECTIVES", "FIRST_BUCKET_BYTES", "HOST_MODES", "MODES",
           "OPTIMIZERS", "Compute", "Convert", "Lowering", "LoweringError", "OptimizerCost",
           "Program", "Task", "Wait", "gkey", "kernel_tasks", "local_shape", "lower",
           "optimizer_cost", "task_label", "tensor_nbytes", "tensor_shape", "vkey"]
