"""megabam: long-context pretraining with BAM and SWAX."""
