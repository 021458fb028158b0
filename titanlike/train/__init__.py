"""The training loop: Trainer (build + loop), the pipeline-parallel step, the loss."""
