"""What every script in scripts/ does at its edges: exit quietly when its reader goes away, and keep an error's exit
status when --debug shows its traceback."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Callable

# The status of a process stopped by SIGPIPE (`yes | head`): what a shell tool gives when its reader closed the pipe.
CLOSED_STDOUT = 128 + int(signal.SIGPIPE)


def run_main(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """main(argv) -> its status; when stdout was closed under it (`script.py ... | head`), CLOSED_STDOUT and no
    traceback. Python ignores SIGPIPE so that a socket's EPIPE is an error, not death (a training run talks to peers
    over sockets), so the pipe's end arrives as BrokenPipeError instead."""
    try:
        code = main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's teardown
        return code
    except BrokenPipeError:
        # Later writes (logging's, the interpreter's final flush) go nowhere instead of raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_STDOUT


def debug_traceback(e: BaseException) -> None:
    """--debug: the traceback on stderr; the caller still returns the error's own exit status (2 for bad input)."""
    traceback.print_exception(type(e), e, e.__traceback__)


def tell_launcher(message: str) -> None:
    """Under torchrun (it sets TORCHELASTIC_ERROR_FILE for each worker): the error's first line goes into this
    worker's error file, so torchrun's failure summary shows it as the rank's "traceback" instead of a link to its
    docs. torchrun still prints its own ChildFailedError traceback above that summary: the agent process raises it,
    out of a worker's reach. Never raises."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    lines = message.strip().splitlines()
    first = lines[0] if lines else message
    # The format torch's ErrorHandler.record_exception writes (torch 2.11 and 2.13 read it alike); the summary
    # prints py_callstack, so it holds the one line, not a traceback.
    data = {"message": {"message": first, "extraInfo": {"py_callstack": first, "timestamp": str(int(time.time()))}}}
    try:
        with open(f"{path}.tmp-{os.getpid()}", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.tmp-{os.getpid()}", path)
    except OSError:
        pass
