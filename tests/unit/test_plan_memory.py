"""titanlike/planner/memory.py: the memory estimate against real allocations (one process, real CPU tensors), FSDP
shards on fake ranks, and a large config traced without real weight memory."""
import subprocess
import sys

import dataclasses

import pytest
import torch

from titanlike.config.load import load_config
from titanlike.planner import estimate_memory


def _debug_cfg(tmp_path, *extra, world_size=1, config="configs/debug_model.toml"):
    return load_config(["--config", config, f"--job.dump_folder={tmp_path}",
                        "--metrics.enable_tensorboard=false", "--training.device=cpu", *extra], world_size=world_size)


# nemotron_h_debug: a hybrid (Mamba-2 scans, attention, MLP), 2 s. qwen3_next_debug also matches (peak within 0.01%)
# but costs 7 s on 2 cores: left out.
@pytest.mark.parametrize("config", ["configs/debug_model.toml", "configs/qwen3_debug_moe.toml",
                                    "configs/nemotron_h_debug.toml"])
def test_debug_model_matches_real_trainer(tmp_path, config):
    """Parameter/gradient/optimizer bytes exactly what a real Trainer allocates; the traced peak within 15% of the
    peak the same tracker (MemTracker) measures on real CPU tensors for a real second train_step (the optimizer
    state then exists through forward and backward, as in every step of a run but the first). The MoE model is traced
    with balanced routing (titanlike/planner/moe.py); the real step routes as its random init does."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from titanlike.train.trainer import Trainer

    cfg = _debug_cfg(tmp_path, config=config)
    est = estimate_memory(cfg, 1, device_kind="cpu")
    (r,) = est.ranks
    trainer = Trainer(cfg)
    try:
        params = list(trainer.model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        data = iter(trainer.dataloader)
        trainer.train_step(trainer.next_batches(data))  # step 1 creates the optimizer state
        batches = trainer.next_batches(data)
        mt = MemTracker()
        mt.track_external(trainer.model, trainer.optimizer)
        with mt:
            trainer.train_step(batches)
        real_peak = sum(v for k, v in next(iter(mt.get_tracker_snapshot("peak").values())).items()
                        if getattr(k, "value", k) != "Total")
        opt_bytes = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor))
    finally:
        trainer.close()
    assert r.parameters == param_bytes
    assert r.gradients == param_bytes  # fp32 gradients, one per parameter
    assert r.optimizer_states == opt_bytes
    assert abs(r.peak - real_peak) <= 0.15 * real_peak, (r.peak, real_peak)
    assert r.allowance == 0  # no CUDA context on CPU
    assert "GiB" in est.format()


def test_fsdp2_shards_on_fake_ranks(tmp_path):
    """FSDP over 2 fake ranks: each rank's parameter bytes are the dim-0 shards FSDP2 makes (padded to equal
    chunks), computed analytically from the one-process model; optimizer state 2x that (AdamW moments) + steps."""
    import models

    cfg = _debug_cfg(tmp_path, world_size=2)
    est = estimate_memory(cfg, 2, device_kind="cpu")
    (r,) = est.ranks
    one = estimate_memory(_debug_cfg(tmp_path), 1, device_kind="cpu").ranks[0]
    spec = models.get_spec(cfg.model.name)
    args = spec.flavor_args(cfg.model.flavor)
    with torch.device("meta"):
        from titanlike.planner.build import vocab_and_eod

        vocab, _ = vocab_and_eod(cfg.model, cfg.data, spec, [])
        import dataclasses

        m = spec.model_cls(dataclasses.replace(args, vocab_size=vocab, max_seq_len=cfg.training.seq_len))
    shard = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in m.parameters())  # rank 0's chunk
    assert r.parameters == shard
    assert r.gradients == shard
    assert r.parameters < one.parameters
    assert r.peak < one.peak


def test_8b_on_8_fake_ranks_allocates_no_weights(tmp_path):
    """configs/llama3_8b.toml at 8 ranks: bf16 FSDP on the GPU path, traced on fake tensors; the process's
    RSS grows by far less than one rank's weights (no real memory behind the fake tensors); and DTensor's
    global-shaped propagation shadows are not counted (torch 2.11's tracker counted them: the optimizer step's
    "temporaries" came out at the whole model's size)."""
    code = (
        "import resource, time, sys\n"
        "from titanlike.config.load import load_config\n"
        "from titanlike.planner import estimate_memory\n"
        "cfg = load_config(['--config', 'configs/llama3_8b.toml'], world_size=8)\n"
        "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t = time.time(); e = estimate_memory(cfg, 8)\n"
        "r = e.ranks[0]\n"
        "print(time.time() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024, r.parameters, "
        "r.optimizer_states, r.peak, e.peak, r.temporaries)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert out.returncode == 0, out.stderr[-2000:]
    # (the first number, seconds, is for a reader: 40-80 s on a busy 2-core machine; speed is not asserted here)
    _secs, rss_growth, params, opt, peak, total, temps = map(float, out.stdout.split()[-7:])
    assert params > 3 * 2 ** 30  # ~7B fp32 parameters / 8 ranks
    assert rss_growth < 0.2 * params  # no real weights
    assert opt >= 2 * params  # AdamW moments (+ step counters)
    assert peak > params + opt and total > peak
    assert temps < 2 * params, (temps, params)  # 0.7x here; the whole model (32x) when the shadows were counted


def _meta_model(cfg):
    import models
    from titanlike.planner.build import vocab_and_eod

    spec = models.get_spec(cfg.model.name)
    vocab, _ = vocab_and_eod(cfg.model, cfg.data, spec, [])
    args = dataclasses.replace(spec.flavor_args(cfg.model.flavor), vocab_size=vocab, max_seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        return spec.model_cls(args)


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_shards_experts_on_fake_ranks(tmp_path, ep):
    """The debug MoE model on 4 fake ranks with expert parallelism: each rank holds total expert bytes / ep / efsdp
    of the routed experts (ep=2: EP 2 x FSDP 2 over efsdp; ep=4: EP only, the experts outside FSDP) and rank 0's
    FSDP chunk of every dense parameter (over all 4 ranks), exactly; the step traces through EP's all-to-alls."""
    from models.common.moe import GroupedExperts

    cfg = _debug_cfg(tmp_path, f"--parallelism.ep={ep}", world_size=4, config="configs/qwen3_debug_moe.toml")
    est = estimate_memory(cfg, 4, device_kind="cpu")
    (r,) = est.ranks
    m = _meta_model(cfg)
    expert_ids = {id(p) for mod in m.modules() if isinstance(mod, GroupedExperts) for p in mod.parameters()}
    experts = sum(p.numel() * 4 for p in m.parameters() if id(p) in expert_ids)
    dense = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) * 4 for p in m.parameters() if id(p) not in expert_ids)
    efsdp = 4 // ep
    assert experts % (ep * efsdp) == 0
    assert r.parameters == dense + experts // ep // efsdp
    assert r.gradients == r.parameters
    assert any("balanced routing" in n for n in est.notes)
    assert r.peak > r.parameters


def test_float8_estimate_runs(tmp_path):
    """float8 (torchao Float8Linear, tensorwise) traces as it is: torch._scaled_mm has a fake kernel, so the float8
    casts, scales and saved float8 activations are in the trace (no bf16 approximation). Same weights as bf16."""
    cfg = load_config(["--config", "configs/debug_model.toml", "--float8.enable=true"], world_size=1)
    f8 = estimate_memory(cfg, 1).ranks[0]
    bf16 = estimate_memory(load_config(["--config", "configs/debug_model.toml"], world_size=1), 1).ranks[0]
    assert f8.parameters == bf16.parameters
    assert 0 < f8.peak and f8.activations != bf16.activations


def test_compiled_saved_bytes_of_known_graphs():
    """titanlike/planner/compiled.py reads what Inductor's partitioner keeps for backward: an elementwise chain keeps
    only its input (which is not counted: it lives anyway), a matmul -> ReLU -> matmul keeps one [n, h] tensor
    (and recomputes the rest), whatever the parameters are."""
    from titanlike.planner.compiled import saved_bytes

    x = torch.randn(64, 32, requires_grad=True)
    assert saved_bytes(lambda a: torch.nn.functional.silu(a) * a.cos(), (x,), {}) == 0
    w1, w2 = torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(48, 16))
    got = saved_bytes(lambda a: torch.relu(a @ w1) @ w2, (x,), {})
    assert 64 * 48 * 4 <= got <= 64 * 48 * (4 + 1)  # the ReLU output (or mm output + a 1-byte mask)


def test_compiled_blocks_keep_less_than_eager(tmp_path):
    """With compile on, the GPU estimate counts each block's compiled saved bytes: fewer activations than the eager
    trace without AC, the same with full AC (the checkpoint keeps only the block's input either way)."""
    def act(*extra):
        cfg = _debug_cfg(tmp_path, "--compile.enable=true", *extra)
        (r,) = estimate_memory(cfg, 1, device_kind="cuda").ranks
        return r.activations

    eager = ['--compile.components=["loss", "optimizer"]']  # the same precision mode (master weights)
    assert act("--activation_checkpoint.mode=none") < act("--activation_checkpoint.mode=none", *eager)
    full = act("--activation_checkpoint.mode=full")
    assert full == pytest.approx(act("--activation_checkpoint.mode=full", *eager), rel=0.02)
