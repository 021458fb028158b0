"""Tokenise JSONL into Megatron's indexed .bin/.idx format (flags compatible with Megatron's tools/preprocess_data.py).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --json-keys text \\
        --tokenizer-type Llama3Tokenizer --tokenizer-model /models/llama3/tokenizer.model --append-eod --workers 8

See titanlike/data/preprocess.py and docs/data.md. Exit status: 0 done (bad lines, if any, listed), 1 stopped by
--strict, 2 bad arguments or files.
"""
from __future__ import annotations

import os
import sys

# Running from a source checkout without `pip install -e .` still works.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
