#!/usr/bin/env python3
"""Train, test or plot an IMPALA agent: `python run.py --help` lists every flag."""

from __future__ import annotations

import sys

from impala.config import UserError, parse_config


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(argv)
        if config.mode == "train":
            from impala import training

            training.train(config)
        elif config.mode == "test":
            from impala import evaluate

            evaluate.test(config)
        else:
            from impala import plotting

            plotting.plot(config)
    except UserError as exc:
        print(f"run.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
