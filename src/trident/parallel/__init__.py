"""Models larger than one device: FSDP2 sharding and tensor parallelism on a device mesh (fsdp.py: the one place
a model is parallelized, and the strategy that says whether it shards weights), the mechanics that carry out the
parallel plans the modules declare (tensor_parallel.py), and sharded checkpoints (distributed_checkpoint.py).

Nothing is imported here: each caller imports the module it uses.
"""
