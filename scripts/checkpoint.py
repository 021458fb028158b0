"""Look inside titanlike checkpoints, and load one on a single device.

    python scripts/checkpoint.py inspect PATH [--step N] [--verify] [--filter PREFIX] [--no-tensors] [--no-config]
    python scripts/checkpoint.py verify PATH [--step N]
    python scripts/checkpoint.py load PATH [--device cuda] [--dtype bfloat16] [--seq 2048]

PATH is a run folder, a checkpoint folder (holding step-N/ folders) or one step folder. `inspect` lists every step
with its state, then for one step (default: the newest complete) every tensor with shape, dtype and size, the small
saved states (trainer counters, data position, LR schedule) and the config that wrote it. States:
complete (committed, every file has its recorded size), verified (and every checksum in MANIFEST.json matches:
`--verify` or `verify`), truncated (a file is shorter than recorded, or missing), corrupt (a checksum or a file's
size does not match), corrupt-marker (the COMMITTED marker itself is damaged), interrupted (no marker: the save
never finished). `verify` checks every checksum of every step (or --step N), with a progress bar for big steps: exit
0 when all is well, else 1 with one line per damaged file. `load` rebuilds the model from the step's meta.json on
one device, loads its weights whatever layout wrote them (e.g. FSDP 2 -> 1 GPU for evaluation), times that, and runs
one forward pass on random tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


from titanlike.checkpoint import integrity, layout
from titanlike.checkpoint.layout import CONFIG, CheckpointError
from titanlike.checkpoint.resolve import check_exists, checkpoint_folder, is_step_folder, resolve_step
from titanlike.checkpoint.states import EXTRA, read_meta_json, read_metadata, unpack


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def _folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _check(info: layout.StepInfo, checksums: bool, progress=None) -> tuple[str, list[str]]:
    """(state, one line per damaged file); damage to the marker or manifest alone counts as a damaged file."""
    if not info.loadable:
        return "interrupted", []
    found = layout.check_step(info, checksums, threads=integrity.threads_for("load"), progress=progress)
    return found.state(info), [p[2] for p in found.problems] + found.notes


def list_steps(folder: str, checksums: bool = False) -> list[str]:
    lines = [f"checkpoint folder {os.path.abspath(folder)}"]
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for prefix in ("step", "export-step"):
        for step, info in sorted(layout.scan(folder, prefix).items()):
            m = info.marker or {}
            state, bad = _check(info, checksums)
            if state == "interrupted":
                detail = f"(no {layout.MARKER} marker: its save was interrupted; never loaded)"
            else:
                detail = (f"world {m.get('world_size')}  {'model only' if m.get('model_only') else 'full state'}"
                          f"{'  ' + m['dtype'] if m.get('dtype') else ''}  saved {m.get('committed_at', '?')}"
                          if m else "")
                if state == "complete" and not os.path.isfile(os.path.join(info.path, integrity.MANIFEST)):
                    detail += "  (no checksums: saved before manifests)"
                detail += "".join(f"\n      {line}" for line in bad)
            lines.append(f"  {os.path.basename(info.path):<22} {_size(_folder_size(info.path)):>10}  {state:<14}"
                         f" {detail}".rstrip())
    for name in names:
        if name.endswith(".tmp"):
            lines.append(f"  {name:<22} {'':>10}  unfinished save (never loaded)")
    if len(lines) == 1:
        lines.append("  (no checkpoint steps)")
    return lines


def describe_step(path: str, prefix: str = "", tensors: bool = True, config: bool = True) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_metadata(path)
    lines = [f"step folder {os.path.abspath(path)}"]
    meta = read_meta_json(path)
    if meta:
        lines.append(f"  model {meta.get('model_name')}: {meta.get('model_args')}")
    groups: dict[str, list[int]] = {}
    rows, objects, settings = [], [], 0
    for key, item in sorted(md.state_dict_metadata.items()):
        group = key.split(".")[0]
        if isinstance(item, TensorStorageMetadata):
            numel = 1
            for d in item.size:
                numel *= d
            nbytes = numel * item.properties.dtype.itemsize
            g = groups.setdefault(group, [0, 0, 0])
            g[0], g[1], g[2] = g[0] + 1, g[1] + numel, g[2] + nbytes
            dtype = str(item.properties.dtype).replace("torch.", "")
            if key.startswith(prefix):
                rows.append(f"    {key:<64} {str(list(item.size)):<18} {dtype:<9} {_size(nbytes):>10}")
        elif key.startswith(EXTRA + "."):
            objects.append(key)
        else:
            settings += 1  # the optimizer's per-parameter hyperparameters (lr, betas, ...)
    for group, (n, numel, nbytes) in groups.items():
        lines.append(f"  {group}: {n} tensors, {numel:,} elements, {_size(nbytes)}")
    if settings:
        lines.append(f"  optimizer hyperparameters: {settings} values (per parameter: lr, betas, weight_decay, ...)")
    if tensors and rows:
        lines.append("  tensors (global shapes):")
        lines += rows
    if objects:
        lines.append("  saved states:")
        lines += [f"    {key}: {_object_summary(path, key)}" for key in objects]
    cfg_file = os.path.join(path, CONFIG)
    if config and os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            lines.append("  config that wrote it:")
            lines += [f"    {line}" for line in f.read().splitlines()]
    return lines


def _object_summary(path: str, key: str) -> str:
    """The small states are pickled dicts: show the trainer's and the data loader's; just name the rest."""
    if key not in (f"{EXTRA}.trainer", f"{EXTRA}.dataloader"):
        return "(pickled)"
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from titanlike.checkpoint.states import quiet_dcp

    box = {EXTRA: {key.split(".", 1)[1]: b""}}
    with quiet_dcp():
        dcp.load(box, storage_reader=FileSystemReader(path), no_dist=True)
    state = unpack(next(iter(box[EXTRA].values())), key, path)
    if key.endswith("dataloader"):
        state = state.get("_sampler_iter_state", state)
    return str(state)


def inspect(args) -> int:
    path = args.path
    check_exists(path)
    if is_step_folder(path):
        step_dir = path
        print("\n".join(list_steps(os.path.dirname(os.path.abspath(path)), args.verify)))
    else:
        path = checkpoint_folder(path)  # a run folder: its checkpoint folder
        print("\n".join(list_steps(path, args.verify)))
        if args.step is not None:
            info = layout.scan(path).get(args.step)
            if info is None:
                raise CheckpointError(f"no step-{args.step} in {path}")
        else:  # the newest whose file sizes are right (the listing above shows what is wrong with the others)
            info = layout.choose_step(path, -1, checksums=False)
            if info is None:
                return 0
        step_dir = info.path
    print("\n".join(describe_step(step_dir, args.filter, tensors=not args.no_tensors, config=not args.no_config)))
    return 0


def verify(args) -> int:
    """Every checksum of every step (or --step N) of PATH: one line per step, one per damaged file; exit 1 if any."""
    from tqdm import tqdm

    path = args.path
    check_exists(path)
    if is_step_folder(path):
        infos = layout.candidates(path)
    else:
        path = checkpoint_folder(path)  # a run folder: its checkpoint folder
        infos = [i for prefix in ("step", "export-step") for _, i in sorted(layout.scan(path, prefix).items())]
        if args.step is not None:
            infos = [i for i in infos if i.step == args.step and os.path.basename(i.path).startswith("step-")]
            if not infos:
                raise CheckpointError(f"no step-{args.step} in {path}")
    bad = 0
    for info in infos:
        name = os.path.basename(info.path)
        total = _folder_size(info.path)
        t0 = time.perf_counter()
        with tqdm(total=total, unit="B", unit_scale=True, desc=name, leave=False, file=sys.stderr,
                  disable=total < (256 << 20)) as bar:
            state, lines = _check(info, True, progress=bar.update)
        if state == "interrupted":
            print(f"{name}: interrupted (no {layout.MARKER} marker: its save never finished; loading skips it)")
            continue
        if lines:
            bad += len(lines)
            print(f"{name}: {state}")
            print("\n".join(f"  {line}" for line in lines))
        else:
            how = ("every checksum matches" if state == "verified"
                   else "sizes match (no checksums: saved before manifests)")
            print(f"{name}: {state}: {how} ({_size(total)} in {time.perf_counter() - t0:.1f} s)")
    if not infos:
        print(f"{path}: no checkpoint steps")
    return 1 if bad else 0


def load(args) -> int:
    import torch

    from titanlike.checkpoint import load_model_weights, model_from_meta

    info = resolve_step(args.path, checksums=True)
    device = torch.device(args.device)
    model, model_args = model_from_meta(info.path, max_seq_len=args.seq)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # builds the RoPE table; every weight is overwritten below
    t0 = time.perf_counter()
    step = load_model_weights(info.path, model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    dtype = getattr(torch, args.dtype)
    for p in model.parameters():  # cast weights only: the RoPE table stays float32
        p.data = p.data.to(dtype)
    tokens = torch.randint(0, model_args.vocab_size, (1, args.seq), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    with torch.no_grad():
        t1 = time.perf_counter()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), tokens[0, 1:]).item()
        fwd_s = time.perf_counter() - t1
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded step {step} from {info.path}: {n:,} params onto {device} in {load_s:.2f} s "
          f"(model weights only, written by world size {(info.marker or {}).get('world_size')}); "
          f"forward of {args.seq} random tokens in {args.dtype}: loss {loss:.4f} in {fwd_s:.2f} s")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("inspect", help="steps, tensors, saved states and config of a checkpoint")
    i.add_argument("path")
    i.add_argument("--step", type=int, default=None, help="which step to detail (default: newest complete)")
    i.add_argument("--verify", action="store_true", help="also check every checksum (reads every step)")
    i.add_argument("--filter", default="", help="only tensors whose key starts with this, e.g. model.layers.0")
    i.add_argument("--no-tensors", action="store_true")
    i.add_argument("--no-config", action="store_true")
    v = sub.add_parser("verify", help="check every file of every step against its checksums (exit 1 if damaged)")
    v.add_argument("path")
    v.add_argument("--step", type=int, default=None, help="only this step")
    ld = sub.add_parser("load", help="time a model-only load on one device and run one forward pass")
    ld.add_argument("path")
    ld.add_argument("--device", default="cpu")
    ld.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ld.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    try:
        return {"inspect": inspect, "verify": verify, "load": load}[args.cmd](args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
