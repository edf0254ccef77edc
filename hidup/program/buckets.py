"""Parameter gradients for hidup.program.lowering.Lowering: once complete on a machine, reduced
in buckets as DDP does (a partial sum over the world, a whole one over the mesh's columns), then
the optimizer's update."""
from __future__ import annotations

import math

from hidup.graph.placement import Partial, Placement, R
from hidup.program.tasks import FIRST_BUCKET_BYTES, Compute, Convert, Wait, gkey


class GradientBuckets:
    """Lowering's gradient reductions and update. It reads the Lowering's machines, buckets,
    bucket_bytes, flushed, final, scopes, optimizer, tasks, pending and waited, and calls its
    home, gplace, shape, nbytes, wait_for and add."""

    def param_grad(self, t: str, home: Placement) -> None:
        """Parameter t's gradient is complete on this machine: a partial sum over its ranks goes
        to the world's all-reduce bucket; one that is whole there (a shard, or replicated) is
        final on a 1-D mesh and goes to the mesh columns' bucket on a 2-D one."""
        key = gkey(t, home, None)
        partial = isinstance(self.gplace(t, home), Partial)
        if not partial and self.machines == 1:
            self.final[t] = key
            return
        self.final[t] = "grad:" + t
        scope = "world" if partial else "column"
        bucket = self.buckets[scope]
        bucket.append(t)
        # DDP's first bucket is small, so that communication starts early in the backward
        cap = self.bucket_bytes if scope in self.flushed else \
            min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        if sum(self.nbytes(p, self.home(p)) for p in bucket) >= cap:
            self.flush_bucket(scope)
            self.flushed.add(scope)

    def flush_bucket(self, scope: str) -> None:
        """One all-reduce for the gradients gathered so far (flattened together, as DDP does)."""
        names, self.buckets[scope] = self.buckets[scope], []
        if not names:
            return
        homes = [self.home(p) for p in names]
        for p, h in zip(names, homes):
            self.wait_for(gkey(p, h, None))
        group, groups = self.scopes[scope]
        task = Convert(len(self.tasks), "all_reduce", names[0] if len(names) == 1 else
                       f"bucket({names[0]}..{names[-1]})", Partial(), R, "bwd", None,
                       self.shape(names[0], homes[0]),
                       sum(self.nbytes(p, h) for p, h in zip(names, homes)), group,
                       tuple(gkey(p, h, None) for p, h in zip(names, homes)),
                       tuple("grad:" + p for p in names), (), groups)
        self.add(task)
        for key in task.outputs:
            self.pending.setdefault(key, []).append(task.id)

    def update(self) -> None:
        for scope in self.buckets:
            self.flush_bucket(scope)
        for key in self.final.values():
            self.wait_for(key)
        numel = sum(math.prod(self.shape(p, self.home(p))) for p in self.final)
        opt = self.optimizer  # one kernel over the local parameter shards, costed per element
        self.add(Compute(len(self.tasks), "", opt.op, "update", None, float(opt.flops * numel),
                         float(opt.bytes * numel), (), (), tuple(self.final.values()), ()))
        for task in list(self.tasks):
            if isinstance(task, Convert) and task.collective and task.id not in self.waited:
                self.waited.add(task.id)
                self.add(Wait(len(self.tasks), task.id))
