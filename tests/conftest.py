"""Shared pytest hooks."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo_after_gpu_tests(request):
    """GPU tests build many trainers in one process, each compiling its blocks: without a reset, the guards of earlier
    tests' models pile up on the shared block code until dynamo's recompile limit (8) fails a fullgraph compile. A
    real run has one trainer per process."""
    yield
    if request.node.get_closest_marker("gpu"):
        torch._dynamo.reset()
