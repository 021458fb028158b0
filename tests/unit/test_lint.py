"""The linter is part of the suite (so CI runs it through README's test command): ruff with the rules in
pyproject.toml's [tool.ruff] (unused and undefined names, lines within 120 characters)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[dev]' installs it")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
