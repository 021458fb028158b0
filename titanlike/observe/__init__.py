"""What a run reports: logging, metrics (console, TensorBoard, MFU, memory), profiler traces."""
