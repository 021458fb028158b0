"""Before launch (titanlike/planner/preflight.py, scripts/train.py --dry-run): the verdict against a memory budget,
the cheapest fix when a config does not fit, and the script's exit statuses. No GPU: the estimate traces on fake
tensors."""
import subprocess
import sys

from titanlike.config import load_config
from titanlike.planner.memory import estimate_memory
from titanlike.planner.preflight import check_fits
from tests.launch import REPO_ROOT

BIG_ACTS = ["--config", "configs/debug_model.toml", "--training.seq_len=1024", "--training.local_batch_size=8",
            "--model.vocab_size=256"]


def test_the_fix_is_the_mildest_change_that_fits():
    cfg = load_config(BIG_ACTS)
    full = load_config([*BIG_ACTS, "--activation_checkpoint.mode=full"])
    need, need_full = estimate_memory(cfg, 1).peak, estimate_memory(full, 1).peak
    assert need_full < need  # activations dominate this shape
    fits, report, _ = check_fits(cfg, 1, need * 1.5)
    assert fits and report.endswith(f"of {need * 1.5 / 2**30:.1f} GiB per GPU")
    fits, report, _ = check_fits(cfg, 1, (need + need_full) / 2)
    assert not fits
    verdict = report.splitlines()[-1]
    assert verdict.startswith(f"does not fit: needs {need / 2**30:.1f} GiB per GPU") and "--activation_checkpoint" in \
        verdict, verdict
    fits, report, _ = check_fits(cfg, 1, need_full / 4)
    assert "none of more activation checkpointing" in report and f"at least {need / 2**30:.1f} GiB" in report


def test_dry_run_exit_status_and_no_training(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), *BIG_ACTS, "--dry-run",  # noqa: E731
                                     f"--job.dump_folder={tmp_path}", *a], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=300, env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
                                                                 "PATH": "/usr/bin:/bin"})
    small = run("--gpu-mem=0.1", "--gpus=2")  # (the verdicts themselves: test above)
    assert small.returncode == 1 and "does not fit" in small.stdout and "2 rank(s)" in small.stdout, \
        small.stdout + small.stderr
    assert not (tmp_path / "debug_model").exists()  # nothing was trained, no run folder
    bad = run("--training.sq_len=3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "did you mean" in bad.stderr


def test_where_the_estimate_is_not_yet_trusted():
    """TP (-24% on a 4-layer cut), float8 with selective AC (-14%) and gradient accumulation (-13% to +10%) are
    not within 10% of the measured runs everywhere:
    the trainer warns there instead of refusing, unless the estimate exceeds the GPU by more than that
    (scripts/train.py)."""
    from titanlike.planner.preflight import uncertain

    base = ["--config", "configs/debug_model.toml"]
    f8 = [*base, "--float8.enable=true", "--compile.enable=true"]
    assert uncertain(load_config(base), 1) is None
    assert uncertain(load_config([*base, "--parallelism.tp=2"], world_size=2), 2) == "TP"
    assert uncertain(load_config(f8), 1) is None  # float8 under compile: the compiled blocks' saves are emulated
    assert uncertain(load_config([*f8, "--activation_checkpoint.mode=selective"]), 1) == "float8 with selective AC"
    assert uncertain(load_config([*base, "--training.global_batch_size=16"]), 1) == "gradient accumulation"
