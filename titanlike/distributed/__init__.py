"""Process groups and the device mesh: init/teardown from the torchrun environment, ParallelDims."""
