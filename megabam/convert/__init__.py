"""Checkpoint conversion: `megabam convert inspect|consolidate` (megabam/convert/cli.py)."""
