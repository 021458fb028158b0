"""Translate a Megatron-LM pretrain_gpt.py flag block into a titanlike TOML (docs/megatron.md).

    python scripts/from_megatron.py flags.sh [--out run.toml]
    python scripts/from_megatron.py -- --num-layers 24 --hidden-size 1024 ...
    cat flags.sh | python scripts/from_megatron.py

The TOML goes to stdout (or --out, written atomically); every flag it cannot map is listed on stderr with the reason
and as `# unmapped:` comments at the end of the TOML. A flag missing its value: one error line, exit 2.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from titanlike.config.megatron import MegatronError, parse, to_toml, tokenize, translate


def main(argv: list[str]) -> int:
    out = None
    if "--" in argv:
        i = argv.index("--")
        argv, tokens = argv[:i], argv[i + 1:]
    else:
        tokens = None
    if "--out" in argv:
        i = argv.index("--out")
        if i + 1 >= len(argv):
            print("from_megatron: --out needs a file name", file=sys.stderr)
            return 2
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if tokens is None:
        if len(argv) > 1:
            print(f"from_megatron: one flag file at most, got {argv}", file=sys.stderr)
            return 2
        text = Path(argv[0]).read_text() if argv else sys.stdin.read()
        tokens = tokenize(text)
    try:
        t = translate(parse(tokens))
    except MegatronError as e:
        print(f"from_megatron: {e}", file=sys.stderr)
        return 2
    toml = to_toml(t)
    for flag, why in t.unmapped:
        print(f"unmapped: {flag}: {why}", file=sys.stderr)
    if out is None:
        sys.stdout.write(toml)
    else:
        target = Path(out)
        fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
        with os.fdopen(fd, "w") as fh:
            fh.write(toml)
        os.replace(tmp, target)
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
