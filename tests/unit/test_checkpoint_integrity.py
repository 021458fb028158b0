"""Checkpoint integrity: per-file checksums (MANIFEST.json) against same-size damage, a damaged commit marker, the
messages when no good step is left, `scripts/checkpoint.py inspect/verify`, the pre-flight checks (writable folder,
free disk), the run-folder lock, and the checksum benchmark on a tiny state.

Miniature trainer (Run) and model from test_checkpoint.py; one process, CPU.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple

import pytest
import torch

from tests.launch import REPO_ROOT
from tests.unit.test_checkpoint import Run
from titanlike.checkpoint import CheckpointError, complete_steps, integrity, layout, preflight, scan
from titanlike.resilience.runlock import LOCK, RunLock, acquire_run_lock

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def flip(path, offset=None, n=4096):
    """Same-size damage: invert n bytes in the middle of a file (what a bad disk block or a bit-rotted page does)."""
    size = os.path.getsize(path)
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    assert os.path.getsize(path) == size


def script(name):
    spec = importlib.util.spec_from_file_location(f"_{name}_script", REPO_ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------ 1. same-size corruption
def test_same_size_corruption_falls_back_and_training_matches_the_reference(tmp_path, caplog):
    torch.manual_seed(0)
    expected = Run(tmp_path / "ref", interval=1000).train(5)  # the uninterrupted run

    Run(tmp_path / "run", keep_latest_k=2).train(3)  # steps 2 and 3 kept
    manifest = json.loads((tmp_path / "run" / "step-3" / integrity.MANIFEST).read_text())
    assert manifest["algorithm"] == "crc32" and "__0_0.distcp" in manifest["files"]
    data = tmp_path / "run" / "step-3" / "__0_0.distcp"
    flip(data)  # sizes still match the marker: only the checksums can tell
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        resumed = Run(tmp_path / "run", keep_latest_k=2)
        assert resumed.ckpt.load() == 2
    assert f"skipping damaged step 3 (checkpoint file {data} is corrupt: bytes " in caplog.text
    assert resumed.ckpt.bad_steps == {3} and resumed.ckpt.verified_step == 2
    assert resumed.train(3) == expected[2:]  # steps 3-5 exactly as the uninterrupted run: no wrong numbers
    assert complete_steps(str(tmp_path / "run")) == [4, 5]  # step 3 was re-saved whole, then rotated normally


def test_an_unreadable_manifest_makes_the_step_damaged_not_a_warning(tmp_path, caplog):
    torch.manual_seed(0)
    expected = Run(tmp_path / "ref", interval=1000).train(5)
    Run(tmp_path / "run", keep_latest_k=2).train(3)  # steps 2 and 3 kept
    step3 = tmp_path / "run" / "step-3"
    manifest = step3 / integrity.MANIFEST
    manifest.write_bytes(b"\x00" * manifest.stat().st_size)  # same-size garbage: the marker's sizes still match
    with pytest.raises(CheckpointError) as err:
        Run(tmp_path / "run", load_step=3).ckpt.load()
    msg = str(err.value)
    assert "\n" not in msg and f"{manifest} is unreadable (" in msg and "cannot be verified" in msg, msg
    assert "--checkpoint.verify_checksums=false" in msg and "complete steps: [2]" in msg, msg
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        assert Run(tmp_path / "run", verify_checksums=False).ckpt.load() == 3  # sizes only, as asked, with a warning
    assert "only file sizes were checked (checkpoint.verify_checksums is off)" in caplog.text
    caplog.clear()

    flip(step3 / "__0_0.distcp")  # same-size damage that only the lost checksums could have shown
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        resumed = Run(tmp_path / "run", keep_latest_k=1)
        assert resumed.ckpt.load() == 2
    assert f"skipping damaged step 3 ({manifest} is unreadable" in caplog.text
    assert resumed.ckpt.bad_steps == {3} and resumed.ckpt.verified_step == 2
    assert resumed.train(3) == expected[2:]  # the good step's numbers, not the damaged one's
    assert complete_steps(str(tmp_path / "run")) == [5]


def test_explicit_load_of_a_corrupt_step_fails_with_one_line(tmp_path):
    Run(tmp_path).train(2)
    flip(tmp_path / "step-2" / "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        Run(tmp_path, load_step=2).ckpt.load()
    msg = str(err.value)
    assert "\n" not in msg and "checkpoint.load_step=2: step 2" in msg and "step-2/__0_0.distcp is corrupt" in msg
    assert "complete steps: [1]" in msg  # what else there is
    assert Run(tmp_path, load_step=1).ckpt.load() == 1


def test_keep_latest_k_never_rotates_away_the_newest_verified_step(tmp_path, caplog):
    run = Run(tmp_path, keep_latest_k=2)
    run.train(4)  # steps 3, 4
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-6")  # a newer step (an abandoned branch) ...
    flip(tmp_path / "step-6" / "__0_0.distcp")  # ... that is damaged
    resumed = Run(tmp_path, keep_latest_k=2)
    assert resumed.ckpt.load() == 4
    resumed.train(1)  # saves step 5: keep-last-k would have kept {6, 5} and deleted 4, the last loaded good one
    assert complete_steps(str(tmp_path)) == [4, 5, 6]  # 3 rotated out; 4 kept; damaged 6 neither kept nor deleted
    assert layout.prune(str(tmp_path), 1, 5, protect=(5,), bad=(6,)) == [4]


def test_async_checksums_run_off_the_training_thread(tmp_path, monkeypatch):
    threads = []
    real = integrity.checksum_files

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(integrity, "checksum_files", spy)
    run = Run(tmp_path, async_mode="async", interval=2)
    run.train(4)
    run.ckpt.close()
    assert len(threads) == 2 and all(t.startswith("ckpt-checksum") for t in threads), threads
    assert all(s["checksum_s"] >= 0 for s in run.ckpt.stats if "step" in s)
    for step in (2, 4):
        info = scan(str(tmp_path))[step]
        assert layout.check_step(info).state(info) == "verified"


def test_old_steps_without_a_manifest_load_quietly_with_size_checks(tmp_path, caplog, own_log):
    Run(tmp_path).train(2)
    for step in (1, 2):  # what a step saved before manifests looks like
        folder = tmp_path / f"step-{step}"
        (folder / integrity.MANIFEST).unlink()
        marker = json.loads((folder / layout.MARKER).read_text())
        del marker["files"][integrity.MANIFEST]
        (folder / layout.MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        assert Run(tmp_path).ckpt.load() == 2
    assert own_log() == ""  # no warning spam
    with open(tmp_path / "step-2" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        assert Run(tmp_path).ckpt.load() == 1  # sizes still guard them
    assert "skipping damaged step 2" in caplog.text


def test_ranks_split_the_verification(tmp_path, monkeypatch):
    Run(tmp_path).train(1)
    step = tmp_path / "step-1"
    monkeypatch.setattr(integrity, "CHUNK", 4096)  # many chunks from a small file
    sums = integrity.checksum_files(str(step), integrity.own_files(str(step), 0), threads=3)
    sizes = {k: v["size"] for k, v in sums.items()}
    assert len(sums["__0_0.distcp"]["crc32"]) == -(-sizes["__0_0.distcp"] // 4096)
    flip(step / "__0_0.distcp", offset=5000, n=9000)  # chunks 1-3 (4096-16384)
    shares = [integrity.verify(str(step), sizes, sums, 4096, share=(r, 3), threads=2) for r in range(3)]
    whole = integrity.verify(str(step), sizes, sums, 4096)
    assert integrity.merge(shares) == whole and [p[1] for p in whole] == ["__0_0.distcp"]
    assert "bytes 4096-8192 do not match" in whole[0][2] and whole[0][3] == 4096
    assert all(len(s) <= 1 for s in shares) and sum(len(s) for s in shares) == 3  # each rank found its own chunk


# ------------------------------------------------------------------------------------ 2. a damaged marker
def test_garbage_marker_keeps_and_uses_an_intact_step(tmp_path, caplog, own_log):
    run = Run(tmp_path, keep_latest_k=1)
    run.train(2)  # step 2 only
    marker = tmp_path / "step-2" / layout.MARKER
    marker.write_bytes(b"\x00garbage{" * 7)
    assert scan(str(tmp_path))[2].state == "corrupt-marker"
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        resumed = Run(tmp_path, keep_latest_k=1)
        assert resumed.ckpt.load() == 2  # not "interrupted": its files match MANIFEST.json
    assert "step-2/COMMITTED is unreadable (corrupt-marker" in caplog.text and "match MANIFEST.json" in caplog.text
    assert "partial" not in own_log()
    resumed.train(2)  # steps 3, 4 with keep_latest_k=1: step 2 is never deleted
    assert (tmp_path / "step-2" / "__0_0.distcp").is_file() and marker.read_bytes().startswith(b"\x00garbage")
    assert complete_steps(str(tmp_path)) == [4]

    (tmp_path / "step-2" / integrity.MANIFEST).unlink()  # no manifest either: DCP's .metadata gives the sizes
    shutil.rmtree(tmp_path / "step-4")
    assert Run(tmp_path).ckpt.load() == 2
    with open(tmp_path / "step-2" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"step 2 .* is damaged: .*__0_0.distcp is truncated: 100 bytes"):
        Run(tmp_path).ckpt.load()
    assert (tmp_path / "step-2").is_dir()


# ------------------------------------------------------------------------------------ 3. no other step
def test_damaged_only_step_says_no_other_step_exists_and_what_to_do(tmp_path):
    Run(tmp_path).train(1)
    flip(tmp_path / "step-1" / "__0_0.distcp")
    for load_step in (-1, 1):
        with pytest.raises(CheckpointError) as err:
            Run(tmp_path, load_step=load_step).ckpt.load()
        msg = str(err.value)
        assert "\n" not in msg and "step 1" in msg and "__0_0.distcp is corrupt" in msg, msg
        assert f"no other step exists in {tmp_path}: move {tmp_path / 'step-1'} elsewhere" in msg, msg
        assert "checkpoint.initial_load_path" in msg and "load another step" not in msg, msg
    shutil.copytree(tmp_path / "step-1", tmp_path / "step-2")
    with pytest.raises(CheckpointError, match=r"every committed checkpoint step in .* is damaged \(step 2: .*; "
                                              r"step 1: .*\); no other step exists"):
        Run(tmp_path).ckpt.load()
    assert (tmp_path / "step-1").is_dir() and (tmp_path / "step-2").is_dir()


# ------------------------------------------------------------------------------------ 4. inspect / verify
def test_inspect_shows_states_and_verify_exits_1_per_bad_file(tmp_path, capsys):
    run = Run(tmp_path)
    run.train(4)
    with open(tmp_path / "step-1" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    flip(tmp_path / "step-2" / "__0_0.distcp")
    (tmp_path / "step-3" / layout.MARKER).write_text("{not json")
    (tmp_path / "step-5").mkdir()
    tool = script("checkpoint")
    assert tool.main(["inspect", str(tmp_path), "--no-tensors", "--no-config"]) == 0
    out = capsys.readouterr().out
    states = {line.split()[0]: line.split()[3] for line in out.splitlines() if line.startswith("  step-")}
    assert states == {"step-1": "truncated", "step-2": "complete", "step-3": "corrupt-marker", "step-4": "complete",
                      "step-5": "interrupted"}, out  # a same-size flip needs the checksums: --verify / verify
    assert tool.main(["inspect", str(tmp_path), "--verify", "--no-tensors", "--no-config"]) == 0
    out = capsys.readouterr().out
    states = {line.split()[0]: line.split()[3] for line in out.splitlines() if line.startswith("  step-")}
    assert states["step-2"] == "corrupt" and states["step-4"] == "verified", out

    assert tool.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(bad) == 3, out  # one line per damaged file: step 1's data, step 2's data, step 3's marker
    assert "step-1/__0_0.distcp is truncated" in out and "step-2/__0_0.distcp is corrupt" in out
    assert "step-3/COMMITTED is unreadable" in out and "step-4: verified" in out and "step-5: interrupted" in out
    assert tool.main(["verify", str(tmp_path), "--step", "4"]) == 0
    assert tool.main(["verify", str(tmp_path / "step-4")]) == 0
    assert tool.main(["verify", str(tmp_path / "nope")]) == 2


# ------------------------------------------------------------------------------------ 5. pre-flight
def test_preflight_refuses_an_unwritable_folder(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, mode=0o777, **kw):
        if ".write-probe-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, mode, **kw)

    run = Run(tmp_path / "ckpt")
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(CheckpointError) as err:
        run.ckpt.preflight()
    msg = str(err.value)
    assert "\n" not in msg and f"checkpoint folder {tmp_path / 'ckpt'} is not writable (read-only file system" in msg
    assert "checkpoint.folder" in msg
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=f"ckpt lies under {tmp_path / 'file'}, a file: move"):
        Run(tmp_path / "file" / "ckpt").ckpt.preflight()  # a folder that cannot even be created
    with pytest.raises(CheckpointError, match=f"checkpoint folder {tmp_path / 'file'} is a file, not a folder"):
        Run(tmp_path / "file").ckpt.preflight()
    run.ckpt.preflight()  # writable: passes, and leaves no probe file behind
    assert os.listdir(tmp_path / "ckpt") == []
    Run(tmp_path / "off", enable=False).ckpt.preflight()  # checkpointing off: nothing checked, nothing created
    assert not (tmp_path / "off").exists()


def test_preflight_refuses_too_little_disk_counting_keep_latest_k(tmp_path, monkeypatch):
    run = Run(tmp_path, keep_latest_k=3)
    model, optim = preflight.state_bytes(run.ckpt._model_sd(), run.ckpt.optimizers)
    params = sum(p.numel() for p in run.model.parameters())
    assert model >= 4 * params and optim == 8 * params  # before step 1: AdamW's two fp32 moments assumed
    one = model + optim + preflight.OVERHEAD
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, int(3.5 * one)))
    with pytest.raises(CheckpointError) as err:  # 3 kept + the one being written do not fit
        run.ckpt.preflight()
    msg = str(err.value)
    assert "\n" not in msg and f"checkpoint folder {tmp_path} has " in msg and "keep_latest_k=3 keeps 3" in msg
    assert "lower checkpoint.keep_latest_k" in msg
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, int(4.5 * one)))
    run.ckpt.preflight()
    run.train(2)  # two steps on disk: only 2 more copies are needed now
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, int(2.5 * one)))
    Run(tmp_path, keep_latest_k=3).ckpt.preflight()


def test_trainer_refuses_before_step_1(tmp_path, monkeypatch):
    from titanlike.config.load import load_config
    from titanlike.train.trainer import Trainer

    cfg = load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--job.dump_folder={tmp_path}",
                       "--job.run_name=r", "--training.device=cpu", "--data.dataset=mock", "--model.vocab_size=128",
                       "--training.seq_len=16", "--training.local_batch_size=2", "--checkpoint.enable",
                       "--metrics.enable_tensorboard=false", "--comm.heartbeat_interval_seconds=0"])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 1 << 40, 1000))
    with pytest.raises(CheckpointError, match=r"has 1000\.0 B free, but this run needs about"):
        Trainer(cfg)
    lock = tmp_path / "r" / LOCK
    assert lock.is_file()  # left by the failed start (same process: taken back silently below)
    monkeypatch.undo()
    trainer = Trainer(cfg)
    trainer.close()
    assert not lock.exists()


# ------------------------------------------------------------------------------------ 6. the run lock
def _holder(run_dir, seconds=60):
    """Another process holding the run lock (as a second training run would)."""
    code = (f"import time; from titanlike.resilience.runlock import RunLock; RunLock({str(run_dir)!r}).acquire(); "
            f"print('held', flush=True); time.sleep({seconds})")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_on_the_same_folder_refuses(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(CheckpointError) as err:
            acquire_run_lock(str(tmp_path / "run"), 0, 1)
        msg = str(err.value)
        assert "\n" not in msg and f"pid {holder.pid} on host" in msg and "--job.run_name" in msg, msg
        assert acquire_run_lock(str(tmp_path / "run"), 1, 1).release() is None  # non-zero ranks take no lock
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):  # an unwritable dump folder: the OSError itself, naming the path
        acquire_run_lock(str(tmp_path / "file" / "run"), 0, 1)


def test_stale_locks_are_taken_over_with_a_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir, seconds=0)  # exits right away, without releasing: a kill -9 leaves the same
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        lock = RunLock(str(run_dir)).acquire()
    assert f"pid {holder.pid} is no longer running on this host" in caplog.text
    record = json.loads((run_dir / LOCK).read_text())
    assert record["pid"] == os.getpid() and record["token"] == lock.token
    again = RunLock(str(run_dir)).acquire()  # the same process again (a Trainer built twice): no conflict
    assert not lock.held and lock._stop.is_set()  # the earlier holder is retired: no refresh, no warning
    lock.release()  # no longer the holder: leaves the lock alone
    assert json.loads((run_dir / LOCK).read_text())["token"] == again.token
    again.release()
    assert not (run_dir / LOCK).exists()

    (run_dir / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "earlier", "token": "x"}))
    with pytest.raises(CheckpointError, match="pid 1 on host elsewhere"):  # refreshed recently: alive
        RunLock(str(run_dir)).acquire()
    old = time.time() - 600
    os.utime(run_dir / LOCK, (old, old))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        RunLock(str(run_dir), stale_s=300).acquire().release()
    assert "its holder on host elsewhere last refreshed it" in caplog.text


def test_a_killed_holder_not_yet_reaped_is_not_running(tmp_path, caplog):
    """A killed run whose parent has not reaped it yet (a zombie, as right after kill -9 under a launcher) still
    answers kill(pid, 0); its restart must take the lock over, not refuse."""
    run_dir = tmp_path / "run"
    holder = _holder(run_dir, seconds=0)  # exits at once; not waited for: a zombie until holder.wait()
    deadline = time.time() + 30
    while time.time() < deadline and open(f"/proc/{holder.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="titanlike"):
            RunLock(str(run_dir)).acquire().release()
        assert f"pid {holder.pid} is no longer running on this host" in caplog.text
    finally:
        holder.wait()


def test_the_lock_is_refreshed_while_held(tmp_path):
    lock = RunLock(str(tmp_path), refresh_s=0.05).acquire()
    old = time.time() - 600
    os.utime(tmp_path / LOCK, (old, old))
    deadline = time.time() + 30  # a few refresh periods; more on a loaded machine
    while time.time() - os.path.getmtime(tmp_path / LOCK) > 5 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - os.path.getmtime(tmp_path / LOCK) < 5
    lock.release()


# ------------------------------------------------------------------------------------ 7. the benchmark
def test_checkpoint_bench_runs_on_a_tiny_state(tmp_path):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/bench/checkpoint_bench.py"), "--gib", "0.01",
                          "--folder", str(tmp_path / "bench"), "--device", "cpu"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("save_s", "checksum_s", "checksum_gbps", "verify_cold_s", "verify_cold_gbps", "load_cold_s",
                "save_with_checksums_s", "async_stall_s", "async_total_s", "crc32_gbps"):
        assert result[key] > 0, (key, result)
    assert not (tmp_path / "bench").exists()  # the folder is deleted after
