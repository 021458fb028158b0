"""README's two set-up commands are the contract with users and CI: keep them and .ci/run in step."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_CMD = "OMP_NUM_THREADS=1 python -m pytest -q -n 2 tests"


def test_readme_starts_with_train_and_test_commands():
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1:]
    train, test = block[0], block[1]
    assert train.endswith("python scripts/train.py --config configs/debug_model.toml")
    assert test.endswith(TEST_CMD) and "pip install torch==2.13.0" in test


def test_ci_runs_readme_test_command():
    ci = ROOT.joinpath(".ci/run").read_text()
    assert "pip install -q torch==2.13.0" in ci and TEST_CMD in ci
    # a fresh virtual environment, so CI resolves today's versions as a new machine does (an older pytest kept by an
    # earlier run once hid a failure that every fresh install had)
    assert "-m venv" in ci and ci.index("-m venv") < ci.index("torch==2.13.0") < ci.index('-e ".[dev]"')
