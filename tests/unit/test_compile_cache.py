"""compile.cache_dir (titanlike/train/compile_cache.py): a second process on a "new node" (its own empty TMPDIR, so
torch's default caches cannot help) warm-starts from the folder the first one filled, with bitwise the same losses.

One tiny debug model, 2 steps, Inductor on CPU: each process compiles one block (~20 s cold on 2 cores)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT, repo_pythonpath
from titanlike.config import ConfigError, load_config
from titanlike.train.compile_cache import resolve_cache_dir

# The Trainer as scripts/train.py builds it; prints the history's losses exactly (float.hex: bitwise) and what the
# compile cache did (scripts/train.py's log has the losses at 4 decimals only).
_DRIVER = """
import json, sys
from titanlike.config import load_config
from titanlike.observe.log import setup_logging
from titanlike.train.trainer import Trainer
setup_logging()
t = Trainer(load_config(sys.argv[1:]))
try:
    h = t.train()
finally:
    t.close()
c = t.compile_cache
print("RESULT " + json.dumps({"losses": [m["loss"].hex() for m in h], "loaded": c.loaded, "saved": c.saved,
                              "first": c.first_step}))
"""

_TINY = ["--config", "configs/debug_model.toml", "--model.n_layers=1", "--model.args={dim=64,n_heads=4,n_kv_heads=2}",
         "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=2", "--training.device=cpu",
         "--lr_scheduler.warmup_steps=1", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
         "--compile.enable=true", "--compile.components=[\"model\"]", "--compile.backend=inductor"]


def _run(tmp_path, name: str, cache: str) -> dict:
    tmp = tmp_path / f"tmp_{name}"  # this "node's" /tmp: empty, so torch's default cache folder is empty too
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1", PYTHONPATH=repo_pythonpath())
    p = subprocess.run([sys.executable, "-c", _DRIVER, *_TINY, f"--compile.cache_dir={cache}",
                        f"--job.dump_folder={tmp_path / f'out_{name}'}"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_second_process_warm_starts_from_the_artifacts_alone(tmp_path):
    cache = tmp_path / "shared" / "compile_cache"
    cold = _run(tmp_path, "cold", str(cache))
    assert cold["loaded"] == 0 and cold["saved"] > 0 and cold["first"]["fx_miss"] > 0, cold
    split = cold["first"]["split"]  # where the cold first step's compile went (logged as "compile split: ...")
    assert split["graphs"] >= 1 and split["forward"] > 0 and split["backward"] > 0 and split["codegen"] > 0, split
    assert split["forward"] + split["dynamo"] <= cold["first"]["seconds"], split
    files = sorted(os.listdir(cache / "artifacts"))
    assert len(files) == 2 and files[0].endswith("-rank0.bin"), files  # torch version + layout + rank
    record = json.loads((cache / "artifacts" / files[1]).read_text())  # what a later miss is compared with
    assert record["model"]["n_layers"] == 1 and record["training"]["seq_len"] == 16 and "torch" in record["versions"]
    # Only the portable artifact file travels: the on-disk Inductor/Triton caches are gone, so hits come from it.
    for sub in ("inductor", "triton"):
        shutil.rmtree(cache / sub, ignore_errors=True)
    warm = _run(tmp_path, "warm", str(cache))
    assert warm["losses"] == cold["losses"], (cold, warm)
    assert warm["loaded"] > 0 and warm["first"]["fx_hit"] > 0 and warm["first"]["aot_hit"] > 0, warm
    assert warm["first"]["fx_miss"] == 0, warm
    # Times are printed, not asserted (pytest -s shows them): on CPU the C++ kernels still build from the cached code.
    print(f"first step: cold {cold['first']['seconds']:.1f} s, warm from artifacts {warm['first']['seconds']:.1f} s")


def test_cache_dir_that_is_a_file_is_one_line_naming_the_key(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--compile.cache_dir={tmp_path / 'f'}"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("compile.cache_dir=") and "not a folder" in msg, msg


def test_resolve_cache_dir(tmp_path):
    assert resolve_cache_dir("", str(tmp_path)) is None  # torch's defaults, unchanged
    assert resolve_cache_dir("auto", str(tmp_path)) == str(tmp_path / "compile_cache")
    assert resolve_cache_dir(str(tmp_path / "x"), "/elsewhere") == str(tmp_path / "x")


def test_start_points_every_cache_into_the_folder(tmp_path, monkeypatch):
    from titanlike.train.compile_cache import CompileCache

    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.setenv(k, "")  # recorded, so the teardown restores what the process had
        monkeypatch.delenv(k)
    CompileCache(str(tmp_path / "cc"), 0, "cpu-world1").start()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"  # fla's @triton.autotune choices survive a restart
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # the user's choice wins
    CompileCache(str(tmp_path / "cc"), 0, "cpu-world1").start()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_misses_say_why_in_one_line(tmp_path, monkeypatch, caplog):
    """A warm start that still misses names the recorded fields that changed since the save (or that none did); a
    start without artifacts for its key names the keys the folder has."""
    import logging

    import titanlike.train.compile_cache as cc

    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    folder = tmp_path / "cc"
    (folder / "artifacts").mkdir(parents=True)
    (folder / "artifacts" / "torch2.99-cpu-w1-rank0.bin").write_bytes(b"")
    fp = cc.graph_fingerprint(load_config(["--config", str(REPO_ROOT / "configs/debug_model.toml")]))
    cache = cc.CompileCache(str(folder), 0, "cpu-w1", fp)
    with caplog.at_level(logging.INFO, logger="titanlike"):
        cache.start()
    (line,) = [r.message for r in caplog.records if r.message.startswith("compile cache:")]
    assert "no artifacts yet" in line and "the folder has torch2.99-cpu-w1-rank0" in line, line

    # the record a save leaves, from a run with 2 more layers and another sequence length
    saved = json.loads(json.dumps(cache.fingerprint, default=str))
    saved["model"]["n_layers"], saved["training"]["seq_len"] = 4, 512
    (folder / "artifacts" / f"{cache.key}.json").write_text(json.dumps(saved))
    cache._read_record()
    assert cache.miss_reason() == "changed since the save: model.n_layers 4 -> -1; training.seq_len 512 -> 128"
    # the first step's line, as after loading artifacts that still missed
    cache.loaded, cache._t0, cache._c0, cache._times0 = 5, 0.0, dict.fromkeys(cc._counters(), 0), {}
    monkeypatch.setattr(cc, "_counters", lambda: {"fx_hit": 1, "fx_miss": 2, "fx_bypass": 0, "aot_hit": 1,
                                                  "aot_miss": 1, "aot_bypass": 0})
    monkeypatch.setattr(cc.CompileCache, "_save", lambda self: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titanlike"):
        cache.first_step_done()
    (why,) = [r.message for r in caplog.records if "misses after loading" in r.message]
    assert why == ("compile cache: 3 misses after loading 5 artifacts; changed since the save: model.n_layers 4 -> "
                   "-1; training.seq_len 512 -> 128"), why
    (folder / "artifacts" / f"{cache.key}.json").write_text(json.dumps(cache.fingerprint, default=str))
    cache._read_record()
    assert cache.miss_reason().startswith("nothing recorded changed")


def test_split_line_counts_autotuning(monkeypatch):
    """The first step's compile split names Inductor's autotuning (GEMM templates at compile time, Triton kernels'
    config benchmarks at their first launch) beside the phases, in one line."""
    from torch._dynamo.utils import compilation_time_metrics

    from titanlike.train.compile_cache import _compile_times, split_line

    before = _compile_times()
    monkeypatch.setitem(compilation_time_metrics, "mm_template_autotuning", [1.5])
    monkeypatch.setitem(compilation_time_metrics, "CachingAutotuner.benchmark_all_configs", [0.25, 0.25])
    monkeypatch.setitem(compilation_time_metrics, "bytecode_tracing", [3.0])  # a phase, not autotuning
    times = {k: v - before.get(k, 0) for k, v in _compile_times().items()}
    assert times["autotune"] == 2.0, times
    line = split_line({**times, "graphs": 2})
    assert "\n" not in line and line.startswith("compile split: 2 graphs;") and line.endswith("autotuning 2.0 s"), line
