#!/usr/bin/env python3
"""Train, test or plot an IMPALA agent: `python run.py --help` lists every flag.

Exit codes: 0 done; 1 the run failed (actors dying too often, non-finite updates, a bug: the log says
why); 2 bad input (a flag, an env id, a path, a checkpoint: one line on stderr, nothing changed);
130 stopped by Ctrl-C, 143 by SIGTERM and 129 by SIGHUP (the terminal closed), after an orderly shutdown with a
final checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import NoReturn

# A shell's background job starts with Ctrl-C ignored; its run takes Ctrl-C all the same (`stop_requests`), and so
# before the run's own handler is in, as in a terminal: from the first line on, not after the imports.
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from impala.config import UserError, given_flags, ignored_flags_line, parse_config, unused_training_flags_line
from impala.stopping import exit_after_runs, ignore_stop_signals, stop_with_launcher

STARTED_S = time.monotonic()  # before torch is imported: a run's elapsed time counts its start-up

# How long the exit may take once the run has ended (its final checkpoint and logs written and closed): the
# threads it waits for, the atexit handlers. Longer, and the process ends anyway (`exit_within`).
EXIT_GRACE_S = 60.0


def main(argv: list[str] | None = None, started_s: float | None = None) -> int:
    """`started_s`: when the program started (time.monotonic()), where a run's elapsed time counts from."""
    try:
        config = parse_config(argv)
        if config.mode == "train":
            from impala import training
            from impala.stopping import Stopped

            if (unused := unused_training_flags_line(config, given_flags(argv))) is not None:
                print(unused, file=sys.stderr)
            try:
                training.train(config, started_s=started_s)
            except Stopped as stopped:
                return stopped.exit_code
            except training.TrainingError as exc:
                print(f"run.py: training failed{_rank()}: {exc}", file=sys.stderr)
                return 1
        else:
            given = given_flags(argv)
            if config.mode == "test":
                from impala import evaluate

                evaluate.test(config, env_from_checkpoint="env" not in given)
            else:
                from impala import plotting

                plotting.plot(config)
            if (ignored := ignored_flags_line(config.mode, given)) is not None:
                print(ignored, file=sys.stderr)  # after the mode's work: an error is one line
    except UserError as exc:
        print(f"run.py: error{_rank()}: {' '.join(str(exc).splitlines())}", file=sys.stderr)  # one line, always
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _rank() -> str:
    """" (rank R)" in a torchrun rank other than 0, else "": which process a line is from, where only another
    rank's failed."""
    rank = os.environ.get("RANK", "0") if "LOCAL_RANK" in os.environ else "0"
    return "" if rank == "0" else f" (rank {rank})"


def exit_within(exit_code: int) -> NoReturn:
    """Exit with `exit_code` once the run has ended, and never hang or crash doing it.

    This does what the interpreter's exit does for a program (wait for the threads that are not daemons, run
    the atexit handlers: multiprocessing's, logging's, finalizers; flush stdout and stderr), then ends the
    process without the interpreter's own teardown. There, a daemon thread still inside a torch call when the
    interpreter stops is ended in the middle of a C++ destructor, and the whole process aborts ("terminate
    called without an active exception", killed by SIGABRT: the run's exit code lost). Nothing needs that
    teardown: the run wrote its final checkpoint and closed its files before `main` returned.

    If that work still runs EXIT_GRACE_S later (a thread it waits for, an atexit handler stuck on a lock),
    every thread's stack goes to stderr, so that the culprit is named, and the process ends with the same code.
    """

    def force() -> None:
        print(f"run.py: the process had not exited {EXIT_GRACE_S:g} s after the run ended; the stacks of its "
              f"threads follow, then it exits with code {exit_code}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(exit_code)

    ignore_stop_signals()  # done: a late signal of the process group (`timeout`'s second) must not kill the exit
    timer = threading.Timer(EXIT_GRACE_S, force)
    timer.daemon = True
    timer.start()
    for thread in threading.enumerate():
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()  # prints, and goes past, a handler's exception, as the interpreter's exit does
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a pipe whose reader is gone
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # what C and C++ libraries printed through the C library's buffers
    os._exit(exit_code)


if __name__ == "__main__":
    stop_with_launcher()  # a torchrun rank whose torchrun is killed stops in order rather than training on alone
    # A crash of this process (a segfault or abort in a library, a GPU driver's) prints every thread's Python
    # stack to stderr before it dies, as the actors' and the evaluator's do: where the learner was, for one.
    faulthandler.enable()
    exit_after_runs()
    exit_within(main(started_s=STARTED_S))
