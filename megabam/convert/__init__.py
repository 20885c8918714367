"""Checkpoint conversion: `megabam convert inspect|consolidate|reshard|to-hf|from-hf` (megabam/convert/cli.py).
The formats themselves live in megabam/checkpoint."""
