"""Tensor parallelism and the process-group topology it runs on (one module per job).

- `topology.py`: the data × pipeline × tensor layout and every process group;
- `mappings.py`: the collectives as autograd functions whose backward is the dual collective;
- `tensor_parallel.py`: column/row-parallel linears, the vocab-parallel embedding and loss, `apply_tp`;
- `deepspeed_mpu.py`: the topology as DeepSpeed's model-parallel unit (ZeRO over the data group).
"""
