"""Everything that makes a built model run over several processes (one module per job).

- `layout.py`: the data × pipeline × tensor sizes and the project's rank order;
- `topology.py`: the one owner of that layout's process groups (`Topology`, `build_topology`);
- `distributed.py`: joining the process group (`init_distributed`), a local world for conversions;
- `ranks.py`: who this process is, from whichever launcher started it (`launch_environment`);
- `threads.py`: torch's threads per process (cores ÷ local ranks), flushing denormals, set when a rank starts;
- `mappings.py`: the TP/SP collectives as autograd functions whose backward is the dual collective;
- `tensor_parallel.py`: column/row-parallel linears, the vocab-parallel embedding and loss, and
  `apply_tp`, which interprets the modules' tensor-parallel plans (megabam/model/sharding.py);
- `sequence_parallel.py`: `apply_sp`, sequence shards between the tensor-parallel regions;
- `compile.py`: `apply_compile`, torch.compile of each block (train.compile), the kernels' calls outside the graphs;
- `activation_checkpoint.py`: `apply_ac`, activation recomputation;
- `pipeline.py`: the model cut into DeepSpeed pipeline stages, and prediction through them;
- `pipeline_layers.py`: the pipeline's layer order by Decoder name (shared with the checkpoint reader);
- `deepspeed_mpu.py`: the topology as DeepSpeed's model-parallel unit (ZeRO over the data group);
- `parallelize.py`: the order in which the above are applied to a built model.
"""
