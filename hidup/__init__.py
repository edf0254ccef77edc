"""HiDup: SPMD sharding with Duplex computation-communication overlap.

The Python API (hidup.api): `hidup.plan(model, example_inputs, cluster=..., gpus=...)` -> Plan,
`hidup.Plan.load(path)`, and `hidup.parallelize(model, plan, optimizer=...)` -> Trainer. The
names load on first use, so that `python -m hidup.train --help` stays quick."""

__all__ = ["Plan", "Trainer", "parallelize", "plan"]


def __getattr__(name: str):
    if name in __all__:
        from hidup import api

        return getattr(api, name)
    raise AttributeError(f"module 'hidup' has no attribute {name!r}")
