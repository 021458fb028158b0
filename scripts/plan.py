"""Plan a run before launching it.

  python scripts/plan.py estimate --config CONFIG [--section.key=value ...] --gpus N [--gpu-mem GiB] [--device cuda|cpu]
                                  [--debug]
  python scripts/plan.py plan --config CONFIG [--section.key=value ...] --gpus N [--gpu h100] [--gpu-mem GiB]
                              [--top 5] [--out BEST.toml] [--no-float8]

estimate: each kind of rank's memory for one training step (titanlike/planner/memory.py: the real model and plan on N
fake ranks, traced on fake tensors; no GPU needed), as a table in GiB, and whether it fits --gpu-mem (default 80).
Exit 0 when it fits, 1 when it does not (one line naming the smallest memory that would fit) or the estimate fails
(one line; --debug: the traceback), 2 on bad input (an unknown config key, impossible degrees, a flag's value that is
not a number) with one line.

plan: every layout of the config's model on N GPUs of that kind that the config check accepts (data/tensor/pipeline/
context/expert parallel degrees, micro-batch size at the config's global batch and sequence length, AC mode, float8,
resharding), ranked by predicted tokens/s (titanlike/planner/cost.py, constants from docs/benchmarks.md); the fastest
are estimated for memory until --top of them fit --gpu-mem (default: the kind's) with 5% to spare. A layout whose
parameters, gradients and optimizer state alone exceed the GPU is not traced (one line counts them), and one the
estimator cannot trace is reported in one line and skipped. Each estimated layout is printed as it is found (a
progress line on stderr before each); then the ones that fit with predicted tokens/s, MFU and memory, and the best
is written as a TOML extending the config (--out). Exit 1 when none fits, naming the smallest estimate seen.
"""
from __future__ import annotations

import logging
import math
import sys


def _take(argv: list[str], flag: str, default: str | None) -> tuple[list[str], str | None]:
    out, value, i = [], default, 0
    while i < len(argv):
        a = argv[i]
        if a == flag and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return out, value


def _number(flag: str, value: str | None, kind: type, example: str, least: float) -> float | int | None:
    """The value of a numeric flag, or a ValueError naming the flag (one line for the user)."""
    if value is None:
        return None
    try:
        got = kind(value)
    except ValueError:
        got = None
    if got is None or not math.isfinite(got) or (got < least if kind is int else got <= least):
        name = f"a whole number >= {least:g}" if kind is int else f"a number > {least:g}"
        raise ValueError(f"{flag}: {value!r} is not {name} ({example})")
    return got


def _say(line: str = "") -> None:
    print(line, flush=True)  # each line as it is found, also when the output goes to a file or a pipe


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("estimate", "plan"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "plan":
        return plan_main(argv[1:])
    argv = argv[1:]
    argv, gpus = _take(argv, "--gpus", "1")
    argv, gpu_mem = _take(argv, "--gpu-mem", "80")
    argv, device = _take(argv, "--device", "cuda")
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    from titanlike.config import ConfigError, load_config

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        n = _number("--gpus", gpus, int, "GPUs in the run, e.g. 8", 1)
        mem_gib = _number("--gpu-mem", gpu_mem, float, "GiB per GPU, e.g. 80", 0)
        if device not in ("cuda", "cpu"):
            raise ValueError(f"--device: {device!r} is not cuda or cpu")
        cfg = load_config(argv, world_size=n)
        from titanlike.planner import estimate_memory

        est = estimate_memory(cfg, n, device_kind=device)
    except (ConfigError, ValueError) as e:
        lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]  # "N config errors:" header
        print(f"error: {first}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a layout the estimator cannot trace: one line (--debug: the traceback)
        if debug:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"error: the memory estimate failed ({type(e).__name__}: {first}); --debug shows where",
              file=sys.stderr)
        return 1
    print(est.format())
    need = est.peak / 2 ** 30
    if est.fits(int(mem_gib * 2 ** 30)):
        print(f"fits: {need:.1f} GiB needed per GPU of {mem_gib:g} GiB")
        return 0
    print(f"does not fit: needs {need:.1f} GiB per GPU, more than --gpu-mem {mem_gib:g} GiB; smallest memory that "
          f"would fit: {need:.1f} GiB")
    return 1


def plan_main(argv: list[str]) -> int:
    argv, gpus = _take(argv, "--gpus", "1")
    argv, gpu_name = _take(argv, "--gpu", "h100")
    argv, gpu_mem = _take(argv, "--gpu-mem", None)
    argv, top = _take(argv, "--top", "5")
    argv, out = _take(argv, "--out", None)
    no_float8 = "--no-float8" in argv
    argv = [a for a in argv if a != "--no-float8"]
    from titanlike.config import ConfigError, load_config
    from titanlike.planner.gpus import UnknownGpu, gpu_kind
    from titanlike.planner.memory import estimate_memory
    from titanlike.planner.planner import GIB, overrides_toml, plan

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        n = _number("--gpus", gpus, int, "GPUs in the run, e.g. 8", 1)
        mem = _number("--gpu-mem", gpu_mem, float, "GiB per GPU, e.g. 80", 0)
        top = _number("--top", top, int, "how many layouts that fit to list, e.g. 5", 1)
        gpu = gpu_kind(gpu_name)
        mem = mem if mem is not None else gpu.memory_gib
        base = load_config(argv)  # the layout keys are the planner's to choose: checked per candidate
        config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
        config = config or next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    except (ConfigError, ValueError, UnknownGpu) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    gbs = base.training.global_batch_size
    _say(f"planning {base.model.name} {base.model.flavor} on {n} x {gpu.name} ({mem:g} GiB), seq "
         f"{base.training.seq_len}, global batch {gbs if gbs > 0 else 'local x dp'}")
    _say("candidates estimated, fastest predicted first:")
    smallest = []

    def estimate(cfg, world):
        peak = estimate_memory(cfg, world).peak
        smallest.append(peak)
        return peak

    def progress(line):
        print(line, file=sys.stderr, flush=True)

    fits, ranked = plan(base, n, gpu, mem, estimate, top=top, allow_float8=not no_float8, log=_say,
                        progress=progress)
    _say(f"{len(ranked)} layouts pass the config check")
    if not fits:
        bounds = [c.lower_bound for c in ranked if c.lower_bound is not None]
        fix = "more GPUs, or a shorter sequence / smaller global batch"
        if smallest:
            least, what = min(smallest) / GIB, f"the smallest estimate among the {len(smallest)} traced was"
        elif bounds:
            least = min(bounds) / GIB
            what = "every layout's parameters, gradients and optimizer state alone need at least"
            fix = "or more GPUs (the weights and optimizer state shard over them)"
        else:
            _say(f"no layout fits {n} x {mem:g} GiB: none of them could be estimated (above)")
            return 1
        _say(f"no layout fits {n} x {mem:g} GiB: {what} {least:,.1f} GiB per GPU; use GPUs with at least "
             f"{least / 0.95:,.1f} GiB, {fix}")
        return 1
    _say(f"\ntop {len(fits)} that fit:")
    for i, c in enumerate(fits, 1):
        print(f"{i}. {c.describe():<60} {c.cost['tokens_per_s_per_gpu']:>9,.0f} tok/s/GPU  MFU "
              f"{100 * c.cost['mfu']:4.1f}%  {c.peak_bytes / GIB:5.1f} GiB")
    if out:
        import os

        base_path = os.path.relpath(os.path.abspath(config), os.path.dirname(os.path.abspath(out))) if config else ""
        text = overrides_toml(base_path, fits[0], f"planned by scripts/plan.py plan --gpus {n} --gpu {gpu.name}: "
                              f"{fits[0].describe()}")
        with open(out + ".tmp", "w") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
