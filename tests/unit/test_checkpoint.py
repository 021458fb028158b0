"""CheckpointManager in one process: full-state round trip (sync and both async modes), commit markers, keep-last-k,
partial and damaged steps, wrong shapes, failed writes that leave earlier steps intact, seed / export, inspect.

Multi-process resume and resharding: tests/multiproc/test_dist_checkpoint.py; HF interop: test_checkpoint_hf.py.
"""
from __future__ import annotations

import errno
import importlib.util
import logging
import os
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import models
from tests.launch import REPO_ROOT
from titanlike.checkpoint import CheckpointError, CheckpointManager, complete_steps, layout, scan
from titanlike.checkpoint.states import read_metadata
from titanlike.config.load import ConfigError, config_from_dict
from titanlike.config.sections import Checkpoint, Data
from titanlike.config.validate import validate
from titanlike.data import build_dataloader

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP, from its writer thread
VOCAB = 128


def tiny(vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    spec = models.get_spec("llama3")
    torch.manual_seed(seed)
    m = spec.model_cls(spec.args_cls(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, multiple_of=32,
                                     rope_theta=10000.0, max_seq_len=16))
    m.init_weights()
    return m


class Counter:
    def __init__(self):
        self.step, self.tokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, s):
        self.step, self.tokens_seen = s["step"], s["tokens_seen"]


class Run:
    """model + AdamW + LambdaLR + data loader + counters + manager: a miniature trainer."""

    def __init__(self, folder, seed: int = 0, vocab: int = VOCAB, **cfg):
        self.model = tiny(vocab, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=True)
        self.lr = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (s + 1))
        self.data = build_dataloader(Data(dataset="mock"), None, dp_rank=0, dp_degree=1, local_batch_size=2,
                                     seq_len=16, seed=0, vocab_size=VOCAB)
        self.counter = Counter()
        self.cfg = Checkpoint(**{"enable": True, "interval": 1, **cfg})
        self.ckpt = CheckpointManager(self.cfg, str(folder), model=self.model, optimizer=self.opt,
                                      lr_scheduler=self.lr, dataloader=self.data, trainer=self.counter,
                                      model_name="llama3", model_args=self.model.args)
        self.it = None

    def train(self, steps: int, last: int | None = None) -> list[float]:
        if self.it is None:
            self.it = iter(self.data)
        losses = []
        for _ in range(steps):
            x, y = next(self.it)
            loss = torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            loss.backward()
            self.ckpt.wait_for_staging()
            self.opt.step()
            self.lr.step()
            self.opt.zero_grad()
            self.counter.step += 1
            self.counter.tokens_seen += x.numel()
            losses.append(loss.item())
            self.ckpt.maybe_save(self.counter.step, last_step=self.counter.step == last)
        return losses


def test_async_mode_auto_is_sync_on_cpu_and_the_last_async_save_commits_at_close(tmp_path):
    """The default (auto) saves synchronously on a CPU (async on a GPU: tests/gpu/test_gpu_checkpoint.py); an
    async save of the last step is still in flight after maybe_save and committed by close(), before the run exits."""
    assert Checkpoint().async_mode == "auto"
    run = Run(tmp_path / "cpu", interval=100)
    assert run.ckpt.mode == "disabled"
    run = Run(tmp_path / "async", async_mode="async", interval=100)
    run.train(2, last=2)
    run.ckpt.close()
    assert complete_steps(str(tmp_path / "async")) == [2]
    assert layout.read_marker(str(tmp_path / "async" / "step-2"))["mode"] == "async"


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_full_state_roundtrip_continues_identically(tmp_path, mode):
    a = Run(tmp_path, async_mode=mode, interval=2)
    a.train(4)
    a.ckpt.close()
    a.cfg.interval = 1000  # the reference continuation saves nothing more
    torch.manual_seed(1234)
    expected_rand = torch.rand(3)  # the RNG stream right after the save at step 4 ...
    torch.manual_seed(1234)
    expected = a.train(2)  # ... and the next two steps

    b = Run(tmp_path, seed=7, async_mode=mode, interval=2)  # different init: the load must overwrite all of it
    torch.manual_seed(999)
    assert b.ckpt.load() == 4 and b.counter.state_dict() == {"step": 4, "tokens_seen": 4 * 32}
    assert b.lr.last_epoch == 4 and b.opt.state_dict()["state"][0]["step"].item() == 4
    # RNG restored to its state at the save (then reseeded identically, as the run above did)
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(3), expected_rand)
    torch.manual_seed(1234)
    assert b.train(2) == expected  # bitwise: weights, Adam moments, LR and data position all restored
    b.ckpt.close()
    stats = [s for s in a.ckpt.stats if "step" in s]
    assert [s["step"] for s in stats] == [2, 4] and all(s["mode"] == mode for s in stats)
    assert all(s["write_s"] > 0 and s["stall_s"] >= 0 for s in stats)


def test_prestage_allocates_the_staging_buffers_and_changes_nothing(tmp_path, caplog):
    ref = Run(tmp_path / "ref", async_mode="async_with_pinned_mem", interval=2, prestage=False)
    expected = ref.train(4)
    ref.ckpt.close()

    run = Run(tmp_path / "pre", async_mode="async_with_pinned_mem", interval=2)
    weights = [p.detach().clone() for p in run.model.parameters()]
    with caplog.at_level(logging.INFO, logger="titanlike"):
        run.ckpt.prestage()
        run.ckpt._prestaged.future.result()
        run.ckpt._check_prestage(block=False)
    assert "pre-staged" in caplog.text and run.ckpt._prestaged is None
    # the optimizer state exists (so its buffers could be staged) yet is that of a fresh optimizer
    assert len(run.opt.state) == len(weights)
    assert all(s["step"].item() == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in run.opt.state.values())
    assert all(torch.equal(p, w) for p, w in zip(run.model.parameters(), weights))
    cache = run.ckpt._stager._state_dict_stager._inner._cached_storage_mapping  # DCP's StateDictStager cache
    tensors = [p for p in run.model.parameters()] + [s[k] for s in run.opt.state.values()
                                                    for k in ("exp_avg", "exp_avg_sq")]
    staged = {id(t): cache[t.untyped_storage()] for t in tensors}  # KeyError if a buffer was not staged
    assert run.train(4) == expected  # bitwise the run without pre-staging
    # the two saves copied into the very buffers pre-staging allocated
    assert all(cache[t.untyped_storage()] is staged[id(t)] for t in tensors)
    run.ckpt.close()
    assert complete_steps(str(tmp_path / "pre")) == [2, 4]


def test_keep_last_k_partial_and_missing_steps(tmp_path, caplog):
    run = Run(tmp_path, keep_latest_k=2)
    run.train(4)
    assert complete_steps(str(tmp_path)) == [3, 4]
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-5")  # a save that died before its commit marker
    (tmp_path / "step-5" / layout.MARKER).unlink()
    (tmp_path / "step-6.tmp").mkdir()  # and one that died mid-write
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        assert Run(tmp_path).ckpt.load() == 4
    assert "ignoring partial steps [5]" in caplog.text
    with pytest.raises(CheckpointError, match=r"step 5 .* is partial .* complete steps: \[3, 4\]"):
        Run(tmp_path, load_step=5).ckpt.load()
    with pytest.raises(CheckpointError, match=r"load_step=9: no step-9 .* complete steps: \[3, 4\]"):
        Run(tmp_path, load_step=9).ckpt.load()
    assert Run(tmp_path, load_step=3).ckpt.load() == 3
    # the next save of step 5 replaces the partial folder and the stale tmp; keep-last-k never touches partials
    run.train(1)
    assert complete_steps(str(tmp_path)) == [4, 5] and (tmp_path / "step-6.tmp").is_dir()


def test_damaged_steps_are_named_and_kept(tmp_path, caplog):
    Run(tmp_path).train(2)
    data = tmp_path / "step-2" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"{data} is truncated: {size // 2} bytes, .* recorded {size}"):
        Run(tmp_path, load_step=2).ckpt.load()
    with caplog.at_level(logging.WARNING, logger="titanlike"):  # the newest (-1): falls back to step 1
        assert Run(tmp_path).ckpt.load() == 1
    assert f"skipping damaged step 2 (checkpoint file {data} is truncated" in caplog.text
    meta = tmp_path / "step-1" / ".metadata"
    meta.write_bytes(b"\0" * meta.stat().st_size)  # same size, garbage: the checksums catch it
    with pytest.raises(CheckpointError, match=r"load_step=1: step 1 .* damaged: .*step-1/\.metadata is corrupt: "
                                              r"bytes 0-\d+ do not match their crc32 in MANIFEST.json"):
        Run(tmp_path, load_step=1).ckpt.load()
    with pytest.raises(CheckpointError, match=r"cannot read .*step-1/\.metadata .* corrupt"):  # sizes only: DCP
        Run(tmp_path, load_step=1, verify_checksums=False).ckpt.load()
    (tmp_path / "step-1" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"step-1/__0_0.distcp is missing"):
        Run(tmp_path, load_step=1).ckpt.load()
    assert data.exists() and meta.exists()  # a failed load removes nothing


def test_wrong_model_shape_names_key_and_shapes(tmp_path):
    Run(tmp_path).train(1)
    with pytest.raises(CheckpointError, match=r"(?s)tok_embeddings.weight has shape \(128, 64\) in the checkpoint but "
                                              r"\(256, 64\) in this model.*vocab_size"):
        Run(tmp_path, vocab=256).ckpt.load()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_failed_save_keeps_earlier_steps_and_says_why(tmp_path, monkeypatch, mode):
    run = Run(tmp_path, async_mode=mode)
    run.train(2)
    run.ckpt.close()
    before = {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}

    def disk_full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, "__0_0.distcp"))

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(CheckpointError, match=r"saving step 3 failed: .*disk full .*__0_0.distcp. Earlier "
                                              r"checkpoints are untouched .*\[1, 2\]"):
        run.train(1)
        run.ckpt.close()  # async: the failure surfaces when the write is collected
    assert {p: p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "step-3.tmp").exists() and Run(tmp_path).ckpt.load() == 2

    def no_permission(folder, step, prefix="step"):
        raise PermissionError(errno.EACCES, "Permission denied", folder)

    monkeypatch.setattr(layout, "prepare_tmp", no_permission)
    with pytest.raises(CheckpointError, match=rf"permission denied at {tmp_path}; earlier checkpoints"):
        run.ckpt.save(5)


def test_resaving_a_step_replaces_it_only_when_complete(tmp_path):
    run = Run(tmp_path)
    run.train(2)
    old = read_metadata(str(tmp_path / "step-2"))
    run.counter.step = 1  # the run went back: step 2 is written again with other weights
    run.train(1)
    assert complete_steps(str(tmp_path)) == [1, 2] and not (tmp_path / "step-2.superseded").exists()
    assert read_metadata(str(tmp_path / "step-2")) is not old
    # a crash between "old step moved aside" and "new step committed" still leaves a loadable step 2
    os.rename(tmp_path / "step-2", tmp_path / "step-2.superseded")
    os.makedirs(tmp_path / "step-2")
    assert scan(str(tmp_path))[2].path.endswith("step-2.superseded") and Run(tmp_path).ckpt.load() == 2


def test_seed_export_and_model_only_loads(tmp_path):
    seed = Run(tmp_path / "seed", seed=3, enable=False, create_seed_checkpoint=True)
    seed.ckpt.save_seed()
    info = scan(str(tmp_path / "seed"))[0]
    assert info.complete and info.marker["model_only"]
    with pytest.raises(CheckpointError, match="already holds checkpoint steps"):
        seed.ckpt.save_seed()  # nothing is overwritten
    # a run starting from the seed gets its weights (and only them)
    run = Run(tmp_path / "run", seed=5, initial_load_path=str(tmp_path / "seed"), model_only_export=True,
              export_dtype="bfloat16", interval=10)
    assert run.ckpt.load() == 0
    for k, v in seed.model.state_dict().items():
        assert torch.equal(run.model.state_dict()[k], v), k
    run.train(2, last=2)
    export = tmp_path / "run" / "export-step-2"
    md = read_metadata(str(export))
    assert {v.properties.dtype for v in md.state_dict_metadata.values()} == {torch.bfloat16}
    assert not any(k.startswith("optimizer") for k in md.state_dict_metadata)
    assert complete_steps(str(tmp_path / "run")) == [2]  # the export is not a resumable step
    last = Run(tmp_path / "last", last_save_model_only=True)  # the last step writes the export only
    last.train(2, last=2)
    assert complete_steps(str(tmp_path / "last")) == [1] and (tmp_path / "last" / "export-step-2").is_dir()
    evaluation = tiny(seed=9)
    from titanlike.checkpoint import load_model_weights

    assert load_model_weights(str(export), evaluation) == 2
    for k, v in run.model.state_dict().items():
        assert torch.equal(evaluation.state_dict()[k], v.to(torch.bfloat16).float()), k


def test_config_rules():
    with pytest.raises(ConfigError, match="checkpoint.export_dtype='fp8'"):
        validate(config_from_dict({"checkpoint": {"export_dtype": "fp8"}}))
    with pytest.raises(ConfigError, match="create_seed_checkpoint runs on one process"):
        validate(config_from_dict({"checkpoint": {"create_seed_checkpoint": True}}), world_size=2)


def test_inspect_script(tmp_path, capsys):
    run = Run(tmp_path, keep_latest_k=1)
    run.train(2)
    (tmp_path / "step-3").mkdir()
    spec = importlib.util.spec_from_file_location("_ckpt_script", REPO_ROOT / "scripts" / "checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"step-2 .* complete +world 1  full state", out) and re.search(r"step-3 .* interrupted", out)
    assert "model.layers.0.attention.wq.weight" in out and "[64, 64]" in out and "float32" in out
    assert "extra.trainer: {'step': 2, 'tokens_seen': 64}" in out
    assert script.main(["inspect", str(tmp_path / "nope")]) == 2
    assert script.main(["load", str(tmp_path), "--seq", "8"]) == 0
    assert "loaded step 2" in capsys.readouterr().out


@pytest.fixture
def restore_logging():
    """scripts/train.py's main() configures the "titanlike" logger (no propagation, a handler on this test's
    captured stdout): put it back, or later tests' caplog sees nothing."""
    log = logging.getLogger("titanlike")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]


def test_train_script_seed_checkpoint(tmp_path, capsys, restore_logging):
    spec = importlib.util.spec_from_file_location("_train_script", REPO_ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--config", str(REPO_ROOT / "configs/debug_model.toml"), f"--job.dump_folder={tmp_path}",
            "--job.run_name=seeded", "--training.device=cpu", "--data.dataset=mock", "--model.vocab_size=256",
            "--checkpoint.create_seed_checkpoint", "--metrics.enable_tensorboard=false"]
    assert script.main(argv) == 0
    folder = tmp_path / "seeded" / "checkpoint"
    assert complete_steps(str(folder)) == [0] and scan(str(folder))[0].marker["model_only"]
    assert script.main(argv) == 1  # a second seed would overwrite nothing: refused with one line
    assert "already holds checkpoint steps [0]" in capsys.readouterr().err


def test_pinned_stager_survives_close_after_each_staging():
    """torch 2.11's DefaultStager closes its inner stager after every staging (pytorch#183413): the next save
    failed with KeyError: <class 'type'> on the GPU machine. Do what 2.11 does between two stagings here."""
    from titanlike.checkpoint.staging import make_pinned_stager

    stager = make_pinned_stager()
    try:
        sd = {"w": torch.arange(4.0), "nested": {"b": torch.ones(2)}, "step": 3}
        first = stager.stage(sd).result()
        stager._state_dict_stager.close()  # torch 2.11 does this at the end of every _stage()
        sd["w"].add_(10)
        second = stager.stage(sd).result()
        assert torch.equal(first["w"], torch.arange(4.0) + 10)  # the cached buffer was reused and refreshed
        assert torch.equal(second["w"], torch.arange(4.0) + 10) and second["step"] == 3
    finally:
        stager.close()
        stager._state_dict_stager.release()
