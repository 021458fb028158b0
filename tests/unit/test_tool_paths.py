"""Every tool takes a run folder, a checkpoint folder or a step folder (titanlike/checkpoint/resolve.py), and every
script ends quietly when its stdout is closed (`| head`) and keeps exit status 2 for bad input under --debug."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest
import torch

import models
from tests.launch import REPO_ROOT
from titanlike.checkpoint.hf import write_model_step
from titanlike.checkpoint.resolve import resolve_step
from titanlike.cli import CLOSED_STDOUT, run_main
from titanlike.infer.load import build_model


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder as training leaves it: run/checkpoint/step-0 (a tiny model-only step)."""
    root = tmp_path_factory.mktemp("tools") / "run"
    spec = models.get_spec(models.DEFAULT_MODEL)
    args = dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_layers=1, n_heads=4, n_kv_heads=2,
                               vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(spec, args, torch.device("cpu"), torch.float32)
    write_model_step(str(root / "checkpoint"), models.DEFAULT_MODEL, args, model.state_dict(), {}, "test", "test",
                     "test")
    return root


def test_every_tool_takes_a_run_checkpoint_or_step_folder(run, tmp_path, capsys):
    step = run / "checkpoint" / "step-0"
    sources = [run, run / "checkpoint", step]
    assert {resolve_step(str(s)).path for s in sources} == {str(step)}
    generate, checkpoint, convert_hf, convert_megatron, evaluate = (
        _script(n) for n in ("generate", "checkpoint", "convert_hf", "convert_megatron", "evaluate"))
    for i, src in enumerate(map(str, sources)):
        assert generate.main([src, "--tokens", "1,2,3", "--max-new-tokens", "2"]) == 0
        assert capsys.readouterr().err.strip() == f"loaded step 0 from {step}"
        assert checkpoint.main(["inspect", src, "--no-tensors"]) == 0
        assert f"step folder {step}" in capsys.readouterr().out
        assert checkpoint.main(["verify", src]) == 0
        assert checkpoint.main(["load", src, "--seq", "8"]) == 0
        assert f"loaded step 0 from {step}" in capsys.readouterr().out
        assert convert_hf.main(["export", src, str(tmp_path / f"hf{i}"), "--no-progress"]) == 0
        assert convert_megatron.main(["export", src, str(tmp_path / f"meg{i}")]) == 0
        assert evaluate._resolve(evaluate._parser().parse_args(["--checkpoint", src])) == (str(step), 0)
    assert checkpoint.main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_closed_stdout_ends_quietly_in_process(run, monkeypatch):
    """checkpoint.py inspect ... | head: the reader is gone; no traceback, the status of a SIGPIPE'd tool."""
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert run_main(_script("checkpoint").main, ["inspect", str(run)]) == CLOSED_STDOUT
    finally:
        out.close()


def test_debug_keeps_exit_2(tmp_path, capsys):
    assert _script("generate").main([str(tmp_path / "nope"), "--prompt", "x", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "does not exist" in err


def test_damaged_inputs_and_file_outputs_are_one_line(run, tmp_path, capsys):
    """A truncated or garbage safetensors file, an output path that is a file or under one, a Megatron checkpoint
    whose .metadata is garbage: exit 2 and one line naming the file, no traceback."""
    convert_hf, convert_megatron = _script("convert_hf"), _script("convert_megatron")
    hf = tmp_path / "hf"
    assert convert_hf.main(["export", str(run), str(hf), "--no-progress", "--dtype", "float32"]) == 0
    weights = (hf / "model.safetensors").read_bytes()
    for name, data in (("truncated", weights[: len(weights) // 2]), ("garbage", b"not a safetensors file at all")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_bytes((hf / "config.json").read_bytes())
        (bad / "model.safetensors").write_bytes(data)
        assert convert_hf.main(["import", str(bad), str(tmp_path / f"{name}_out"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{bad / 'model.safetensors'} is not a readable safetensors file" in err[0], err
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, words in ((afile, f"{afile} is a file, not a folder"), (afile / "sub", f"lies under {afile}, which is")):
        assert convert_hf.main(["export", str(run), str(out), "--no-progress"]) == 2
        assert convert_megatron.main(["export", str(run), str(out)]) == 2
        assert convert_hf.main(["import", str(hf), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 3 and all(words in line for line in err), err
    meg = tmp_path / "meg"
    (meg / "iter_0000001").mkdir(parents=True)
    (meg / "latest_checkpointed_iteration.txt").write_text("1")
    (meg / "iter_0000001" / ".metadata").write_bytes(b"garbage, not a pickle")
    assert convert_megatron.main(["import", str(meg), str(tmp_path / "meg_out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{meg / 'iter_0000001' / '.metadata'} could not be read" in err[0], err
