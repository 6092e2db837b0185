#!/usr/bin/env python3
"""Train, test or plot an IMPALA agent: `python run.py --help` lists every flag.

Exit codes: 0 done; 1 the run failed (actors dying too often, non-finite updates, a bug: the log says
why); 2 bad input (a flag, an env id, a path, a checkpoint: one line on stderr, nothing changed);
130 stopped by Ctrl-C and 143 by SIGTERM, after an orderly shutdown with a final checkpoint.
"""

from __future__ import annotations

import sys

from impala.config import UserError, parse_config
from impala.stopping import ignore_stop_signals


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
        if config.mode == "train":
            from impala import training
            from impala.stopping import Stopped

            try:
                training.train(config)
            except Stopped as stopped:
                return stopped.exit_code
            except training.TrainingError as exc:
                print(f"run.py: training failed: {exc}", file=sys.stderr)
                return 1
        elif config.mode == "test":
            from impala import evaluate

            evaluate.test(config)
        else:
            from impala import plotting

            plotting.plot(config)
    except UserError as exc:
        print(f"run.py: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)  # one line, always
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    exit_code = main()
    ignore_stop_signals()  # done: a late signal of the process group (`timeout`'s second) must not kill the exit
    sys.exit(exit_code)
