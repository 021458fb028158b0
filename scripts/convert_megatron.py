"""Convert between Megatron-LM checkpoints and titanlike checkpoints (local files only), for every model family with a
Megatron adapter (models/<name>/megatron.py). No megatron install is needed for either direction.

    python scripts/convert_megatron.py import MEGATRON_DIR OUT [--iteration N] [--family NAME]
                                       [--vocab-size N] [--megatron-arg NAME=VALUE ...] [--dtype float32]
        MEGATRON_DIR: a Megatron-LM --save folder (latest_checkpointed_iteration.txt + iter_XXXXXXX/) or one iter_
            folder, in torch_dist or the legacy mp_rank_XX[_YYY]/model_optim_rng.pt format (any TP x PP).
            The architecture comes from the checkpoint's args; --megatron-arg sets or overrides one (Megatron's
            argument name, e.g. --megatron-arg num_query_groups=8). The family follows from
            --position-embedding-type (learned_absolute, rope), or a hybrid model's layer pattern / Mamba --spec,
            unless --family names it.
            Megatron's padded vocabulary is kept unless --vocab-size N (the tokenizer's size) drops the padding.
        OUT/step-0: a model-only titanlike checkpoint; train from it with --checkpoint.initial_load_path=OUT
    python scripts/convert_megatron.py export CKPT OUT [--dtype bfloat16] [--iteration 0]
                                       [--make-vocab-size-divisible-by 128]
        CKPT: a titanlike run or checkpoint folder (newest complete step), or a step folder; any layout.
        OUT: a Megatron-LM --load folder in torch_dist (megatron.core.dist_checkpointing.load reads it into a model
            built with the printed flags; Megatron reshards it to any TP/PP). With Megatron-LM, load it with
            --ckpt-format torch_dist --finetune --no-load-optim --no-load-rng.

Errors (not a Megatron folder, missing iteration or shard, unsupported architecture, existing output) exit with
status 2 and one line naming the problem and the fix.
"""
from __future__ import annotations

import argparse
import ast
import sys

from titanlike.checkpoint.layout import CheckpointError

DTYPES = ["float32", "bfloat16", "float16"]


def _override(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=VALUE, e.g. num_query_groups=8")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word: a string (position_embedding_type=rope)
    return name.lstrip("-").replace("-", "_"), parsed


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="Megatron-LM checkpoint -> titanlike checkpoint")
    imp.add_argument("megatron_dir")
    imp.add_argument("out")
    imp.add_argument("--iteration", type=int, default=None, help="default: latest_checkpointed_iteration.txt")
    imp.add_argument("--family", default=None, help="titanlike model family; default: the one whose adapter "
                     "claims the checkpoint's args (position embedding, hybrid pattern)")
    imp.add_argument("--vocab-size", type=int, default=None,
                     help="keep only the first N embedding/output rows (default: Megatron's padded size)")
    imp.add_argument("--megatron-arg", type=_override, action="append", default=[], metavar="NAME=VALUE",
                     help="set a Megatron argument the checkpoint lacks or has wrong (repeatable)")
    imp.add_argument("--dtype", choices=DTYPES, default=None, help="default: keep the checkpoint's dtype")
    exp = sub.add_parser("export", help="titanlike checkpoint -> Megatron-LM torch_dist checkpoint")
    exp.add_argument("ckpt")
    exp.add_argument("out")
    exp.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    exp.add_argument("--iteration", type=int, default=0, help="the iteration number the checkpoint gets")
    exp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="pad the vocabulary as Megatron-LM's flag of that name does (times the TP you load with)")
    a = p.parse_args(argv)
    from titanlike.checkpoint import megatron

    try:
        if a.cmd == "import":
            r = megatron.import_megatron(a.megatron_dir, a.out, iteration=a.iteration, family=a.family,
                                         overrides=dict(a.megatron_arg), vocab_size=a.vocab_size, dtype=a.dtype)
            args = r["model_args"]
            flavor = (f"--model.flavor={r['flavor']}" if r["flavor"] else
                      f"(no titanlike flavor has these shapes: add one to models/{r['model']}/flavors.py)")
            print(f"read {r['format']} iteration {r['iteration']}; wrote {r['path']} ({args.n_layers} layers, dim "
                  f"{args.dim}, vocab {args.vocab_size}).\n"
                  f"train from it: --checkpoint.enable --checkpoint.initial_load_path={a.out} "
                  f"--model.name={r['model']} {flavor} --model.vocab_size={args.vocab_size}")
            for note in r["notes"]:
                print(f"note: {note}")
        else:
            r = megatron.export_megatron(a.ckpt, a.out, dtype=a.dtype, iteration=a.iteration,
                                         make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
            print(f"wrote {r['path']}: load it with Megatron-LM --load {a.out} --ckpt-format torch_dist --finetune "
                  f"--no-load-optim --no-load-rng {megatron.megatron_flags(r['args'])}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
