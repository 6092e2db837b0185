#!/usr/bin/env bash
# Runs several training configs side by side for a fixed wall time and prints each one's learning
# curve (mean return of the last 100 games against agent steps). The proxy runs behind the defaults.
# Usage: bash scripts/sweep.sh SECONDS "FLAGS A" "FLAGS B" ...    (env: SWEEP_DIR, BASE_FLAGS, OUT)
set -uo pipefail
if [ $# -lt 2 ]; then echo "usage: bash scripts/sweep.sh SECONDS \"FLAGS A\" \"FLAGS B\" ..." >&2; exit 2; fi
seconds=$1; shift
dir=${SWEEP_DIR:-runs/sweep}
base=${BASE_FLAGS:---env PongNoFrameskip-v4 --total_steps 5000000}
for j in $(seq 1 $#); do  # an existing cJ would be resumed with other flags and its old curve reported
  if [ -e "$dir/c$j" ]; then echo "sweep.sh: $dir/c$j exists; set SWEEP_DIR to a new directory" >&2; exit 2; fi
done
mkdir -p "$dir"
i=0
for flags in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  timeout -s INT "$seconds" python3 run.py $base $flags --savedir "$dir" --xpid "c$i" > "$dir/c$i.out" 2>&1 &
done
wait
if [ -n "${OUT:-}" ]; then for j in $(seq 1 $i); do cp "$dir/c$j/logs.csv" "$OUT/c$j.csv"; done; fi
python3 - "$dir" "$@" <<'PY'
import csv, sys
from pathlib import Path
d = Path(sys.argv[1])
for i, flags in enumerate(sys.argv[2:], 1):
    rows = list(csv.DictReader(open(d / f"c{i}" / "logs.csv")))
    print(f"c{i}: {flags}")
    marks, last = [], None
    for r in rows:
        if r.get("charts/mean_return_100"):
            last = r
            step = int(r["step"])
            if not marks or step - marks[-1][0] >= 250_000:
                marks.append((step, float(r["charts/mean_return_100"]), float(r.get("losses/entropy_loss") or "nan")))
    if last:
        marks.append((int(last["step"]), float(last["charts/mean_return_100"]), float(last.get("losses/entropy_loss") or "nan")))
    print("   " + "  ".join(f"{s/1e6:.2f}M:{m:+.1f}" for s, m, _ in marks))
    print(f"   SPS {float(rows[-1]['charts/SPS']):.0f}")
PY
