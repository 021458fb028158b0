"""scripts/bench/speculative_bench.py end to end on CPU (--tiny): trains a 2-layer Llama with two MTP depths through
scripts/train.py, decodes held-out stdlib prompts with plain greedy and with the MTP drafts at depths 1 and 2, and
writes the report; the tokens are identical (fp32) and the statistics add up. Bad input: one line, exit 2."""
from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("speculative_bench", ROOT / "scripts/bench/speculative_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_tiny_run_reports_identical_tokens_and_acceptance(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the training subprocess: 2 shared cores
    torch.set_num_threads(1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the script's temporary run folder lands here
    out = tmp_path / "spec.json"
    assert bench.main(["--tiny", "--out", str(out), "--check-fp32", "on"]) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "mtp draft 2" in printed and "float32 check" in printed and "step     30" in printed
    assert report["mtp_depth"] == 2 and report["dtype"] == "float32" and report["train"]["seconds"] > 0
    assert report["step"] == 30 and "loss" in report["train"]["last_step_line"]
    runs = report["runs"]
    assert [(r["batch"], r["engine"]) for r in runs] == [
        (1, "greedy eager"), (1, "mtp draft 1"), (1, "mtp draft 2"),
        (3, "greedy eager"), (3, "mtp draft 1"), (3, "mtp draft 2")]
    for r in runs:
        assert r["identical"] and r["rows_identical"] == r["rows"] and r["first_divergence"] is None, r
        assert r["new_tokens"] == r["rows"] * 16 and r["tok_s"] > 0 and r["speedup"] > 0
        if r["draft_tokens"]:
            assert 0 <= r["accepted"] <= r["matched"] <= r["drafted"]
            assert r["acceptance_rate"] == round(r["accepted"] / r["drafted"], 4)
            if r["batch"] == 1:  # one row: what it matched is what it commits
                assert r["matched"] == r["accepted"]
            # every verify round commits between 1 and draft + 1 tokens; a prefill commits one
            assert 1.0 <= r["tokens_per_main_forward"] <= r["draft_tokens"] + 1
            assert r["main_forwards"] <= r["calls"] * 16
            assert r["accepted"] > 0  # trained: the drafts are right some of the time (random weights: never)
    assert all(c["identical"] for c in report["fp32_check"])
    assert report["sample"]["tokens"] == 16
    assert not list(tmp_path.glob("specbench-*"))  # the temporary run folder is removed


def test_bad_input_is_one_line(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    for argv, text in ((["--tiny", "--workdir", str(tmp_path)], "holds an earlier run"),
                       (["--tiny", "--single", "5", "--prompts", "2"], "--single=5 exceeds --prompts=2"),
                       (["--tiny", "--prompt-len", "60", "--new-tokens", "16"], "exceeds --seq 64"),
                       (["--tiny", "--decode-only"], "give its --workdir"),
                       (["--tiny", "--steps", "0"], "--steps=0 must be at least 1")):
        assert bench.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and "\n" not in err, err
