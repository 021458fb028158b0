"""The DeepSeek-V3 family's plans on 2 gloo processes against one process (TP 2 with sequence or loss parallel,
FSDP 2, EP 2 x FSDP 2): one launch, the checks in deepseek_v3_worker.py."""
from pathlib import Path

import pytest

from tests.launch import run_torchrun

WORKER = Path(__file__).with_name("deepseek_v3_worker.py")


@pytest.mark.dist
def test_parallel_plans_and_expert_parallel_match_one_process():
    from deepseek_v3_worker import CASES, COMPILE_CASES, RUN_COMPILE

    out = run_torchrun(WORKER, 2, timeout=900 if RUN_COMPILE else 300).stdout
    for name in {**CASES, **(COMPILE_CASES if RUN_COMPILE else {})}:
        assert f"CHECK {name} ok" in out, out
