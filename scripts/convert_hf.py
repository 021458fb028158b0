"""Convert between Hugging Face model folders and titanlike checkpoints (local files only), for every model family
with an HF adapter (models/<name>/hf.py).

    python scripts/convert_hf.py import HF_DIR OUT [--dtype float32]
        HF_DIR: config.json + model.safetensors (or shards + model.safetensors.index.json) + tokenizer files.
        OUT/step-0: a model-only titanlike checkpoint; train from it with
            --checkpoint.initial_load_path=OUT --data.tokenizer=OUT/tokenizer/tokenizer.json
    python scripts/convert_hf.py export CKPT OUT [--dtype bfloat16] [--tokenizer PATH | --no-tokenizer]
                                     [--max-shard-gb 5]
        CKPT: a run folder or checkpoint folder (newest complete step), or a step folder; written under any layout.
        OUT: a folder transformers.AutoModelForCausalLM.from_pretrained(OUT) loads, with the run's tokenizer
            (from the step's config.toml; --tokenizer names another) for AutoTokenizer.from_pretrained(OUT), and
            generation_config.json + config.json's bos/eos ids so generate() stops at the end of text.
        A LoRA run's step (lora.enable) is exported merged, W + alpha/rank * B @ A, its base taken from the run's
            checkpoint.initial_load_path (recorded in the step's meta.json) or --base PATH.
    python scripts/convert_hf.py export-peft CKPT OUT [--base-model HF_DIR_OR_HUB_ID] [--dtype float32]
        A LoRA run's adapters in PEFT's format: OUT/adapter_config.json + OUT/adapter_model.safetensors, loaded with
            peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE_HF), OUT), where BASE_HF is the
            `export` of the base (or the HF model it was imported from). docs/post_training.md#lora.

Errors (missing shard, unsupported architecture, existing output, damaged checkpoint) exit with status 2 and one
line naming the file and what to do.
"""
from __future__ import annotations

import argparse
import sys


from titanlike.checkpoint.layout import CheckpointError

DTYPES = ["float32", "bfloat16", "float16"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="HF folder -> titanlike checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out")
    imp.add_argument("--dtype", choices=DTYPES, default=None, help="default: keep the HF tensors' dtype")
    exp = sub.add_parser("export", help="titanlike checkpoint -> HF folder")
    exp.add_argument("ckpt")
    exp.add_argument("out")
    exp.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    tok = exp.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default=None,
                     help="a tokenizer file or folder (any data.tokenizer format); default: the run's own")
    tok.add_argument("--no-tokenizer", action="store_true", help="no tokenizer files, no bos/eos ids")
    exp.add_argument("--max-shard-gb", type=float, default=5.0)
    exp.add_argument("--max-position-embeddings", type=int, default=None,
                     help="default: the model's context, its flavor's max_seq_len, not the training seq_len "
                          "(YaRN: original x factor; a learned position table: its rows)")
    exp.add_argument("--base", default=None,
                     help="a LoRA run's base checkpoint (default: its checkpoint.initial_load_path, from meta.json)")
    for sp in (imp, exp):
        sp.add_argument("--no-progress", action="store_true")
    peft = sub.add_parser("export-peft", help="a LoRA run's adapters -> PEFT adapter folder")
    peft.add_argument("ckpt")
    peft.add_argument("out")
    peft.add_argument("--base-model", default="", help="adapter_config.json's base_model_name_or_path")
    peft.add_argument("--dtype", choices=DTYPES, default="float32")
    a = p.parse_args(argv)
    from titanlike.checkpoint import hf

    try:
        if a.cmd == "import":
            r = hf.import_hf(a.hf_dir, a.out, dtype=a.dtype, progress=not a.no_progress)
            args = r["model_args"]
            flavor = (f"--model.flavor={r['flavor']}" if r["flavor"] else
                      f"(no titanlike flavor has these shapes: add one to models/{r['model']}/flavors.py)")
            # Only files that were written: the tokenizer flag when the HF folder had a tokenizer file.
            tok = f" --data.tokenizer={r['tokenizer']}" if r["tokenizer"] else ""
            print(f"wrote {r['path']} ({args.n_layers} layers, dim {args.dim}, vocab {args.vocab_size}).\n"
                  f"train from it: --checkpoint.enable --checkpoint.initial_load_path={a.out} "
                  f"--model.name={r['model']} "
                  f"{flavor} "
                  f"--model.vocab_size={args.vocab_size}{tok}")
            if not r["tokenizer"]:
                print(f"{a.hf_dir} has no tokenizer.json or tokenizer.model: set --data.tokenizer to its tokenizer")
        elif a.cmd == "export-peft":
            from titanlike.checkpoint.lora_export import export_peft

            out = export_peft(a.ckpt, a.out, base_model=a.base_model, dtype=a.dtype)
            print(f"wrote {out}: load it with peft.PeftModel.from_pretrained(base_model, {out!r})")
        else:
            out = hf.export_hf(a.ckpt, a.out, dtype=a.dtype, tokenizer=a.tokenizer,
                               max_shard_bytes=int(a.max_shard_gb * 2**30), progress=not a.no_progress,
                               max_position_embeddings=a.max_position_embeddings, with_tokenizer=not a.no_tokenizer,
                               base=a.base)
            print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({out!r})")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from titanlike.observe.log import setup_logging

    from titanlike.cli import run_main

    setup_logging(0)  # the export's notes (tokenizer written or left out, and why); not in main(): tests call it
    sys.exit(run_main(main))
