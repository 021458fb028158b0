"""Units of titanlike/resilience/comm_watch.py and the [comm] / [fault_tolerance] config rules (the multi-process
behaviour: tests/multiproc/test_dist_hang.py, test_dist_torchft.py)."""
import json
import logging
import os
import time

import pytest

from titanlike.config.load import ConfigError, config_from_dict
from titanlike.config.sections import Comm, FaultTolerance
from titanlike.config.validate import validate
from titanlike.resilience.ft import ft_data_shard, ft_run_dir
from titanlike.resilience.comm_watch import Heartbeat, comm_failure_kind, enable_flight_recorder, summarize_heartbeats


def _write(folder, rank, step, entered, inside, progress_ago=5.0, written_ago=0.0):
    now = time.time()
    rec = {"rank": rank, "step": step, "last_progress_unix": now - progress_ago, "written_unix": now - written_ago,
           "host": "h", "pid": 1, "entered": entered, "in_collective": inside}
    (folder / f"rank{rank}.txt").write_text(f"rank {rank} ...\n{json.dumps(rec)}\n")


def test_summary_marks_the_rank_that_never_arrived_and_the_dead_one(tmp_path):
    _write(tmp_path, 0, 7, {"0": 41, "3": 9}, ["gloo:all_reduce (process group 0, collective #41)"])
    _write(tmp_path, 1, 7, {"0": 40, "3": 9}, [])
    _write(tmp_path, 2, 7, {"0": 41, "3": 9}, ["gloo:all_reduce (process group 0, collective #41)"])
    _write(tmp_path, 3, 6, None, None, written_ago=100)
    (tmp_path / "rank4.txt").write_text("half a fi")  # a dying rank's partial write is skipped
    lines = summarize_heartbeats(str(tmp_path), stale_after=30, me=0)
    assert len(lines) == 4 and "this rank" in lines[0] and "likely stuck" not in lines[0] + lines[2]
    assert "not inside any collective  <- likely stuck (never entered collective #41 of process group 0" in lines[1]
    assert "no heartbeat for 100 s: dead or frozen; behind step 7" in lines[3]


def test_heartbeat_file_and_stall_warning(tmp_path, caplog):
    hb = Heartbeat(str(tmp_path), rank=3, interval=60, stall=0.5)
    try:
        hb.progress(12)
        assert (tmp_path / "rank3.txt").read_text().startswith("rank 3 alive at step 0, last progress")
        hb.last_progress -= 2
        with caplog.at_level(logging.WARNING, logger="titanlike"):
            line = hb.beat()
        assert line.startswith("rank 3 alive at step 12, last progress 2.0 s ago")
        assert "comm.heartbeat_stall_seconds=0.5" in caplog.text
        rec = json.loads((tmp_path / "rank3.txt").read_text().splitlines()[1])
        assert rec["step"] == 12 and rec["pid"] == os.getpid()
    finally:
        hb.close()


def test_flight_recorder_environment(tmp_path, monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert enable_flight_recorder(Comm(trace_buf_size=50), str(tmp_path)) is None  # one process: nothing to record
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert enable_flight_recorder(Comm(trace_buf_size=0), str(tmp_path)) is None
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's own setting wins
    folder = enable_flight_recorder(Comm(trace_buf_size=50), str(tmp_path))
    assert folder == str(tmp_path / "comm_traces") and os.path.isdir(folder)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(folder, "rank_")


def test_comm_failure_kinds():
    assert comm_failure_kind(RuntimeError("[gloo] Timed out waiting 2000ms for recv operation")) == "timeout"
    assert comm_failure_kind(RuntimeError("Connection closed by peer [127.0.0.1]:1")) == "peer"
    assert comm_failure_kind(RuntimeError("CUDA out of memory")) is None


def test_config_rules():
    def errors(**sections):
        with pytest.raises(ConfigError) as e:
            validate(config_from_dict(sections), world_size=2)
        return str(e.value)

    ft = {"enable": True, "group_size": 2, "replica_id": 1}
    assert "parallelism.dp_replicate=2 must be 1 with fault_tolerance.enable" in errors(
        fault_tolerance=ft, parallelism={"dp_replicate": 2})
    assert "fault_tolerance.enable with parallelism.pp=2 is not supported" in errors(
        fault_tolerance=ft, parallelism={"pp": 2}, model={"flavor": "debugmodel"})
    assert "multiple of local_batch_size*fault_tolerance.group_size" in errors(
        fault_tolerance=ft, training={"local_batch_size": 2, "global_batch_size": 6})
    assert "comm.train_timeout_seconds=0 must be >= 1" in errors(comm={"train_timeout_seconds": 0})
    assert "fault_tolerance.process_group='mpi' is not one of" in errors(fault_tolerance={"process_group": "mpi"})
    validate(config_from_dict({"fault_tolerance": ft}), world_size=2)


def test_replica_groups_share_the_data_and_keep_their_own_folders(tmp_path):
    on = FaultTolerance(enable=True, group_size=3, replica_id=2)
    assert ft_data_shard(on, dp_degree=4, dp_rank=1) == (12, 9)
    assert ft_data_shard(FaultTolerance(), dp_degree=4, dp_rank=1) == (4, 1)
    assert ft_run_dir(on, "/runs/x") == "/runs/x/replica_2" and ft_run_dir(FaultTolerance(), "/r") == "/r"


def test_fault_tolerance_needs_a_lighthouse(monkeypatch):
    from titanlike.resilience.ft import FaultTolerance as FT

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="fault_tolerance.lighthouse=http://HOST:PORT .* scripts/lighthouse.py"):
        FT(FaultTolerance(enable=True, group_size=2), Comm(), None, model_parts=[], optimizer=None,
           lr_scheduler=None, dataloader=None, trainer=None)


def test_a_rank_whose_process_is_gone_is_marked_exited(tmp_path):
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    for rank, pid in ((0, os.getpid()), (1, gone.pid)):
        rec = {"rank": rank, "step": 4, "last_progress_unix": now, "written_unix": now, "host": socket.gethostname(),
               "pid": pid, "entered": None, "in_collective": None}
        (tmp_path / f"rank{rank}.txt").write_text(f"rank {rank} ...\n{json.dumps(rec)}\n")
    lines = summarize_heartbeats(str(tmp_path), stale_after=30, me=0)
    assert f"<- exited or was killed (process {gone.pid} no longer exists)" in lines[1], lines
    assert "exited" not in lines[0]


def test_the_error_line_reaches_torchruns_failure_summary(tmp_path, monkeypatch):
    """scripts/ write their error's first line into torchrun's per-worker error file: torch's own reader (the one
    its failure summary uses) takes it as the rank's message."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titanlike.cli import tell_launcher

    path = tmp_path / "error.json"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    tell_launcher("error: not under torchrun")
    assert not path.exists()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    tell_launcher("error: rank 0, step 3: rank 1 exited or was killed (...).\nHeartbeats: ...")
    summary = ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1,
                                                              error_file=str(path))}).format_msg()
    assert "  traceback : error: rank 0, step 3: rank 1 exited or was killed (...).\n" in summary, summary


def test_a_lost_peer_inside_a_failed_save_is_found():
    """A save that failed in DCP's collectives (CheckpointError over DCP's CheckpointException over gloo's
    RuntimeError) is a communication failure; a failed save for another reason, or our own errors, are not."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from titanlike.checkpoint import CheckpointError
    from titanlike.resilience.comm_watch import _comm_cause

    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:63657")
    dcp = CheckpointException("save", {1: (ValueError("x"), None), 0: (gloo, traceback.extract_stack())})
    err = CheckpointError("checkpoint: saving step 2 failed: ...")
    err.cause = dcp
    assert _comm_cause(err) is gloo and _comm_cause(gloo) is gloo
    full = CheckpointError("checkpoint: saving step 2 failed: disk full")
    full.cause = OSError(28, "No space left on device")
    assert _comm_cause(full) is None and _comm_cause(CheckpointError("Connection closed by peer")) is None
