"""`megabam plan`: what a config costs before the booking — parameters, FLOPs, memory per GPU,
communication and a roofline step time for a layout, the verdict on the config's own layout and the
best layouts for the GPUs given.

- `hardware.py`: the GPUs' peak rates and bandwidths, one table with its sources;
- `counts.py`: parameters and forward FLOPs per token by component, from the model built on the meta
  device (the trainer's MFU uses the same FLOPs);
- `memory.py`: memory per GPU of a layout (weights, gradients, optimizer, activations, logits, buffers);
- `planner.py`: communication, step time, the verdict and the ranking of layouts;
- `calibration.py`: the calibrated step time beside the roofline, from the per-op efficiencies a GPU
  measured (the table `calibration.json`, written by tools/bench_gpu_train.py);
- `cli.py`: the command.
"""
