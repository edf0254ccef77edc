"""The model as a graph and its sharding rules: `capture` turns an nn.Module and example inputs
into a Graph of ATen ops (shapes, FLOPs from `flops`); `placement` is the vocabulary of where a
tensor lives (Shard, Replicate, Partial) and of an op's sharding options; `ops` holds the rules
that list each op's options."""
