"""HiDup: SPMD sharding with Duplex computation-communication overlap."""
