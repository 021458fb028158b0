"""What every script in scripts/ does at its edges: exit quietly when its reader goes away, and keep an error's exit
status when --debug shows its traceback."""
from __future__ import annotations

import os
import signal
import sys
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
