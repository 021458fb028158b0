"""Planning a run before launching it: titanlike/planner/memory.py (estimate_memory) traces one training step of the
real model under the real plan on fake ranks (fake process group + FakeTensorMode), with no device memory."""
from titanlike.planner.memory import MemoryEstimate, RankMemory, estimate_memory  # noqa: F401

__all__ = ["MemoryEstimate", "RankMemory", "estimate_memory"]
