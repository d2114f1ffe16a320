"""The training loop and what surrounds it: batch assembly, checkpoint/resume, metrics, plots."""
