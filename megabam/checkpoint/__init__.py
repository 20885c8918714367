"""Everything megabam writes to disk of a model and reads back (one module per format):

- `store.py`: a run's checkpoints — atomic collective save, verified load, manifests, `CheckpointMeta`;
- `rng.py`: each rank's random-number state, as JSON;
- `shards.py`: which file holds which shard (DeepSpeed's file names) and the identity each records;
- `weights_only.py`: DeepSpeed's files read with `weights_only=True` (nothing unpickled);
- `reader.py`: a checkpoint of any parallel layout read as the full model's tensors;
- `safetensors_io.py`: sharded safetensors folders written and read one tensor at a time;
- `consolidated.py`: consolidated folders (`megabam convert consolidate`) and `train.init_from`.

Training, conversion and evaluation all stand on this package; it imports none of them.
"""
