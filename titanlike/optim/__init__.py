"""Optimizers: AdamW and its parameter groups and gradient clipping, LR schedules, one-device master weights, and
the container that joins per-stage optimizers."""
