"""Long-context evaluation (passkey retrieval now; NIAH and sliding-window perplexity to come)."""
