"""Where each thread's samples went in a `py-spy record --threads --format raw` file: per thread its share of
all samples, then its most frequent innermost frames (the last DEPTH frames of each stack, default 3).

    python scripts/pyspy_summary.py profile.txt [DEPTH] [TOP]
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict

LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def summarize(lines: list[str], depth: int = 3, top: int = 12) -> str:
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        match = LINE.match(line.rstrip("\n"))
        if not match:
            continue
        frames = match["stack"].split(";")
        thread = frames[0].split(": ", 1)[-1]  # "thread (123): inference" -> "inference"
        threads[thread][";".join(frames[1:][-depth:])] += int(match["count"])
    total = sum(sum(counter.values()) for counter in threads.values()) or 1
    out = []
    for thread, counter in sorted(threads.items(), key=lambda item: -sum(item[1].values())):
        samples = sum(counter.values())
        out.append(f"{thread}: {samples} samples, {samples / total:.1%} of all")
        for stack, count in counter.most_common(top):
            out.append(f"  {count / samples:6.1%}  {stack}")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as file:
        print(summarize(file.readlines(), *(int(arg) for arg in sys.argv[2:4])))
