"""The training loop and what it needs: optimizer, schedule, DeepSpeed engine, logging. Its checkpoints'
format is megabam/checkpoint's."""
