"""Every layout the config check accepts can be estimated, and what the tools print adds up: TP x PP dry-run on fake
ranks (one fake world per pipeline rank in one process), the stage input under sequence parallelism, the table's
lines summing to their totals, --print-config without a world, the planner's lower bound and its one-line skips,
and plan.py's numeric flags."""
import importlib.util
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from titanlike.config import load_config
from titanlike.planner.gpus import gpu_kind
from titanlike.planner.memory import ROWS, estimate_memory
from titanlike.planner.planner import GIB, model_shape, plan, state_lower_bound

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    """scripts/<name>.py as a module; train.py installs signal handlers at import: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        spec = importlib.util.spec_from_file_location(f"_script_{name}", REPO / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _check_sums(text: str) -> int:
    """Each '= ' line of the table is the sum of the lines since the previous '= ' line of its block (that total
    included), to the printed rounding; 'of which' lines are parts of the line above. Returns the totals checked."""
    checked, ncols = 0, None
    run = None
    for line in text.splitlines():
        m = re.match(r"^    (\S.*?)\s{2,}((?:\s*-?\d+\.\d{3})+)$", line)
        if line.startswith("  ") and line.strip().endswith(":") and m is None:
            run = None  # a block's heading
            continue
        if m is None:
            continue
        label, values = m.group(1), [float(v) for v in m.group(2).split()]
        ncols = ncols or len(values)
        assert len(values) == ncols, line
        if label.startswith("of which"):
            continue
        if label.startswith("= "):
            assert run is not None, line
            terms, total = run
            for col in range(ncols):
                got = sum(t[col] for t in terms)
                assert abs(got - values[col]) <= 0.0005 * len(terms) + 1e-9, (line, got)
            checked += 1
            run = ([values], None)
            continue
        run = ([values], None) if run is None else (run[0] + [values], None)
    return checked


def test_tp_pp_dry_run_on_4_fake_gpus(capsys):
    """TP 2 x PP 2 of the debug model on 4 fake GPUs: each pipeline rank is traced in a fake world of its own in one
    process (DTensor's caches must not hand the second world the first one's meshes), and a later stage's input is
    the sequence shard the previous stage sends (not the whole sequence, which the RoPE table would refuse)."""
    train = _script("train")
    code = train.main(["--config", "configs/debug_model.toml", "--parallelism.tp=2", "--parallelism.pp=2",
                       "--dry-run", "--gpus=4", "--metrics.enable_tensorboard=false"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "rank 0: pp rank 0 (ranks 0..1)" in out.out and "rank 2: pp rank 1 (ranks 2..3)" in out.out
    assert _check_sums(out.out) == 4  # state, traced peak, reserved, needed
    assert "view tensor" not in out.err and "random operators" not in out.err


def test_stage_input_is_the_sequence_shard():
    """A later pipeline stage under TP with sequence parallelism gets [b, seq/tp, dim] (a 70B at seq 8192 under TP 8
    read the whole sequence as 65536 tokens); the whole (CP-local) sequence without SP."""
    from titanlike.planner.step import _hidden

    cfg = load_config(["--config", "configs/llama3_70b_tp8_pp2.toml"], world_size=64)
    built = SimpleNamespace(model_args=SimpleNamespace(dim=8192))
    inputs = torch.zeros(1, cfg.training.seq_len, dtype=torch.long)
    with torch.device("meta"):
        x = _hidden(built, inputs, cfg, SimpleNamespace(tp_enabled=True, tp=8), gpu=True)
        cfg.parallelism.enable_sequence_parallel = False
        whole = _hidden(built, inputs, cfg, SimpleNamespace(tp_enabled=True, tp=8), gpu=True)
    assert tuple(x.shape) == (1, 8192 // 8, 8192) and x.dtype == torch.bfloat16
    assert tuple(whole.shape) == (1, 8192, 8192)


def test_every_table_adds_up():
    """The rows sum to their totals in bytes (exactly) and as printed, on a GPU estimate (allocator and context
    allowances) and a CPU one (none), with FSDP."""
    for world, device in ((2, "cuda"), (1, "cpu")):
        cfg = load_config(["--config", "configs/debug_model.toml", "--training.device=cpu"], world_size=world)
        est = estimate_memory(cfg, world, device_kind=device)
        for r in est.ranks:
            terms = []
            for _, attr, role in ROWS:
                if role == "term":
                    terms.append(getattr(r, attr))
                elif role == "total":
                    assert sum(terms) == getattr(r, attr), (attr, terms)
                    terms = [getattr(r, attr)]
                elif role == "head":
                    terms = []
            assert r.state <= r.peak <= r.reserved <= r.total
        assert _check_sums(est.format()) == 4


def test_print_config_needs_no_world(capsys):
    """Every shipped config prints in one process, TP/PP ones included (the degrees need a world only to run)."""
    train = _script("train")
    for path in sorted((REPO / "configs").glob("*.toml")):
        code = train.main(["--config", str(path), "--print-config"])
        out = capsys.readouterr()
        assert code == 0, f"{path.name}: {out.err}"
        assert "[parallelism]" in out.out


def test_planner_prunes_by_the_lower_bound_without_tracing():
    """405B on one GPU: parameters, gradients and optimizer state alone exceed it for every layout, so nothing is
    traced and one line says how much the least of them needs."""
    base = load_config(["--config", "configs/llama3_405b.toml"])
    lines, calls = [], []
    fits, ranked = plan(base, 1, gpu_kind("h100"), 80.0, lambda c, w: calls.append(c) or 0.0, log=lines.append)
    assert not fits and not calls and ranked
    shape, _, _ = model_shape(base)
    least = min(state_lower_bound(shape, c.layout) for c in ranked)
    assert least > 12 * 400e9 * 0.99  # ~4.4 TiB at 12 bytes per parameter, whatever the layout on one GPU
    assert len(lines) == 1 and f"{len(ranked)} layout(s) not traced" in lines[0] and f"{least / GIB:,.1f}" in lines[0]


def test_planner_skips_a_layout_it_cannot_estimate_in_one_line():
    base = load_config(["--config", "configs/debug_model.toml"])
    lines, seen = [], []

    def estimate(cfg, world):
        seen.append(cfg)
        if len(seen) == 1:
            raise RuntimeError("Could not resolve the process group registered under the name 3\nmore")
        return GIB

    fits, _ = plan(base, 2, gpu_kind("h100"), 80.0, estimate, top=2, log=lines.append)
    assert len(fits) == 2 and len(seen) == 3
    assert "skipped: the estimate failed (RuntimeError: Could not resolve" in lines[0] and "more" not in lines[0]


@pytest.mark.parametrize("flag,value,says", [("--gpu-mem", "abc", "'abc' is not a number > 0 (GiB per GPU, e.g. 80)"),
                                             ("--gpus", "2.5", "'2.5' is not a whole number >= 1"),
                                             ("--top", "0", "'0' is not a whole number >= 1")])
def test_plan_script_numeric_flags(capsys, flag, value, says):
    script = _script("plan")
    cmd = "plan" if flag == "--top" else "estimate"
    code = script.main([cmd, "--config", "configs/debug_model.toml", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {flag}: {says}") and err.count("\n") == 1, err
