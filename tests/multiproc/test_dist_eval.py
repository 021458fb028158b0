"""[eval] in the training loop on 2 gloo processes against 1 (titanlike/train/evaluate.py, titanlike/eval/scoring.py):
each DP rank scores its share of the requests; the worker is tests/multiproc/eval_worker.py. Local tasks only
(HF_DATASETS_OFFLINE=1)."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local task must never reach for the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.launch import REPO_ROOT, run_torchrun  # noqa: E402

TASKS = REPO_ROOT / "tests" / "unit" / "data" / "eval_tasks"


@pytest.fixture(scope="module")
def include_path(tmp_path_factory):
    """The repository's task YAMLs with their data files made absolute (they are relative to the repo root)."""
    folder = tmp_path_factory.mktemp("tasks")
    for y in TASKS.glob("*.yaml"):
        (folder / y.name).write_text(y.read_text().replace("tests/unit/data/eval_tasks/", f"{TASKS}/"))
    return str(folder)


@pytest.mark.dist
def test_in_loop_eval_on_two_processes_equals_one_and_leaves_training_alone(tmp_path, include_path):
    """Each DP rank scores its share of the requests: 2 gloo processes give the 1-process results; and a run with
    [eval] every step has bitwise the losses of the same run without it (RNG, data position, weights untouched)."""
    spec = importlib.util.spec_from_file_location("eval_worker", REPO_ROOT / "tests" / "multiproc" / "eval_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    one_with, one_evals = worker.run(worker.eval_config(str(tmp_path / "one"), include_path, 1, True))
    one_without, _ = worker.run(worker.eval_config(str(tmp_path / "one"), include_path, 1, False))
    assert one_with == one_without  # bitwise: exact float equality
    assert len(one_evals) == 2 and "titanlike_tiny_choice/acc" in one_evals[0]
    assert one_evals[0]["titanlike_tiny_rolling/word_perplexity"] > 1

    proc = run_torchrun(REPO_ROOT / "tests" / "multiproc" / "eval_worker.py", 2, [tmp_path / "two", include_path],
                        timeout=240, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    two = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert two["with"] == two["without"]
    assert [e.pop("shard_degree") for e in two["evals"]] == [2, 2]  # each rank scored half of the requests
    [e.pop("shard_degree") for e in one_evals]
    assert two["with"] == pytest.approx(one_with, rel=1e-5)  # FSDP over 2 ranks vs 1: the same global batches
    for a, b in zip(two["evals"], one_evals):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
