"""Translate a Megatron-LM pretrain_gpt.py flag block into a titanlike TOML (docs/megatron.md).

    python scripts/from_megatron.py flags.sh [--out run.toml]
    python scripts/from_megatron.py -- --num-layers 24 --hidden-size 1024 ...
    cat flags.sh | python scripts/from_megatron.py

The input may be a whole launch script: the pretrain_gpt.py launch is found in it (torchrun, srun, python -m ...,
after SLURM headers and other commands) and the variables the script sets are expanded (`TP=8`, `GPT_ARGS="..."`,
arrays). The TOML goes to stdout (or --out, written atomically); which model was chosen, and why, and every flag it
cannot map (with the reason) are listed on stderr, and as `# note:` / `# unmapped:` comments at the end of the TOML.
Nothing to translate (an empty or flagless file), a flag without its value or a contradiction: one error line, exit 2.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

from titanlike.config.megatron import MegatronError, to_toml, translate_text

USAGE = "usage: python scripts/from_megatron.py [FILE | -- FLAGS...] [--out run.toml]   (--help for more)"


def _fail(message: str) -> int:
    print(f"from_megatron: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    out, text = None, None
    if "--" in argv:
        i = argv.index("--")
        argv, text = argv[:i], shlex.join(argv[i + 1:])
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            return _fail("--out needs a file name")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    options = [a for a in argv if a.startswith("-") and a != "-"]
    if options:
        return _fail(f"unknown option {options[0]}; {USAGE} (Megatron flags go after --, or in a file)")
    if len(argv) > 1 or (argv and text is not None):
        return _fail(f"one flag file at most, got {argv}; {USAGE}")
    if text is None:
        if argv and argv[0] != "-":
            try:
                text = Path(argv[0]).read_text()
            except (OSError, UnicodeDecodeError) as e:
                return _fail(f"cannot read {argv[0]}: {getattr(e, 'strerror', None) or e}")
        else:
            text = sys.stdin.read()
    try:
        t = translate_text(text)
    except MegatronError as e:
        return _fail(str(e))
    toml = to_toml(t)
    for line in t.said:
        print(f"model: {line}", file=sys.stderr)
    for flag, why in t.unmapped:
        print(f"unmapped: {flag}: {why}", file=sys.stderr)
    if out is None:
        sys.stdout.write(toml)
        return 0
    target = Path(out)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as fh:
            fh.write(toml)
        os.replace(tmp, target)
    except OSError as e:
        return _fail(f"cannot write {out}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
