"""The training loop and what it needs: optimizer, schedule, DeepSpeed engine, checkpoints, logging."""
