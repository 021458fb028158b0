"""Shared pytest hooks."""
import logging

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


@pytest.fixture
def own_log(caplog):
    """titanlike's own log lines (WARNING and up by default) as text. Tests read these, not `caplog.text`, wherever
    they assert that something was *not* said: pytest >= 9.1 also captures loggers that do not propagate, so
    `caplog.text` carries other libraries' records too (torch's DCP logger writes DEBUG lines on every save/load)."""
    def text(level=logging.WARNING):
        return "\n".join(r.getMessage() for r in caplog.records if r.name.split(".")[0] == "titanlike"
                         and r.levelno >= level)
    return text
