"""Plan a run before launching it.

  python scripts/plan.py estimate --config CONFIG [--section.key=value ...] --gpus N [--gpu-mem GiB] [--device cuda|cpu]

estimate: each kind of rank's memory for one training step (titanlike/plan/memory.py: the real model and plan on N
fake ranks, traced on fake tensors; no GPU needed), as a table in GiB, and whether it fits --gpu-mem (default 80).
Exit 0 when it fits, 1 when it does not (one line naming the smallest memory that would fit), 2 on bad input (an
unknown config key, impossible degrees) with one line.
"""
from __future__ import annotations

import logging
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


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "estimate":
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    argv = argv[1:]
    argv, gpus = _take(argv, "--gpus", "1")
    argv, gpu_mem = _take(argv, "--gpu-mem", "80")
    argv, device = _take(argv, "--device", "cuda")
    from titanlike.config import ConfigError, load_config

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        n, mem_gib = int(gpus), float(gpu_mem)
        if n < 1 or mem_gib <= 0:
            raise ValueError(f"--gpus must be >= 1 and --gpu-mem > 0, got {gpus} and {gpu_mem}")
        cfg = load_config(argv, world_size=n)
        from titanlike.plan import estimate_memory

        est = estimate_memory(cfg, n, device_kind=device)
    except (ConfigError, ValueError) as e:
        lines = [ln.strip(" -") for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        first = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]  # "N config errors:" header
        print(f"error: {first}", file=sys.stderr)
        return 2
    print(est.format())
    need = est.peak / 2 ** 30
    if est.fits(int(mem_gib * 2 ** 30)):
        print(f"fits: {need:.1f} GiB needed per GPU of {mem_gib:g} GiB")
        return 0
    print(f"does not fit: needs {need:.1f} GiB per GPU, more than --gpu-mem {mem_gib:g} GiB; smallest memory that "
          f"would fit: {need:.1f} GiB")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
