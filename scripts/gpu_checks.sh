#!/usr/bin/env bash
# The GPU checks of BENCHMARKS.md ("To re-measure"), one after the other, each output kept in $OUT
# (default ./gpu-out): the gpu-marked tests, the deep ResNet learner row, the shallow net's
# components, and one end-to-end row per inference mode. The default settings as a user meets them, in
# parts: `tests` (the gpu-marked tests), `learner` (the learner alone: eager with --no-cuda_graph, with and
# without --compile; the default's one CUDA graph per update, with --compile, and with the observations stacked on
# the host, --no-pin_slots: GPU busy share, host CPU per step), `defaults` (the components, the actors stepping
# together alone, and the trainer with all cores, `--num_actors auto`: inference in the actors, and central),
# `ablations` (the trainer with the fewest slots, and with --no-pin_slots) and `pong` (the README's Pong command,
# its time to a mean of 18; $EXTRA adds flags, e.g. EXTRA=--no-cuda_graph).
# A --variants string must hold a space ("--compile --inference actor"): argparse takes a lone "--compile"
# for the bench's own flag.
# Usage: bash scripts/gpu_checks.sh [parts|e2e|all|targets|tests|learner|defaults|ablations|placement|inference|threads|main_threads|profile|actors|onednn|pong|pong200|pong_ab|atari5]
#        [TOTAL_STEPS]
set -uo pipefail
out=${OUT:-gpu-out}
what=${1:-all}
steps=${2:-1000000}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; lscpu; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; } > "$out/machine.txt" 2>&1
# pong_for SECONDS NAME [FLAGS...]: the README's Pong command with FLAGS for SECONDS, in $runs/NAME; its out.log and
# logs.csv to $out/NAME_out.log and NAME_logs.csv, and to $out/NAME.txt its first progress line with a mean of 18
# or more (its elapsed time is the time to 18 from run.py's start, start-up included since ae79c3c) and its median
# agent steps/s per interval after the first two (the bench's steady rate).
pong_for() {
  local seconds=$1 name=$2
  shift 2
  rm -rf "${runs:?}/$name"
  timeout "$seconds" python3 run.py --env PongNoFrameskip-v4 --savedir "$runs" --xpid "$name" "$@" > /dev/null 2>&1
  cp "$runs/$name/out.log" "$out/${name}_out.log"; cp "$runs/$name/logs.csv" "$out/${name}_logs.csv"
  # The mean as logs.csv holds it, not as the progress line rounds it (17.96 prints as 18.0).
  { echo "$name ($*): first mean of 18 or more:"
    python3 -c "import re, sys; from pathlib import Path; sys.path.insert(0, 'scripts'); from results import csv_means
from impala.bench import run_scalars
run = Path(sys.argv[1])
steps, means = csv_means(run)
first = next((int(step) for step, mean in zip(steps, means) if mean >= 18), None)
# its progress line: the one of the same step, or the first after it (a run may stop between the two writes)
print(next((line.rstrip() for line in open(run / 'out.log') if first is not None
            and (m := re.search(r' step ([0-9,]+)/', line)) and int(m.group(1).replace(',', '')) >= first), 'none'))
print(f'median agent steps/s per interval after the first two {run_scalars(run)[\"steady_steps_per_s\"]:,.0f}')" \
      "$runs/$name"; } > "$out/$name.txt" 2>&1
}
# The issue's GPU targets in one call of under 10 minutes (a session's device time is 15 minutes, start included),
# the most telling first: the correctness tests of the paths never run on a GPU before (page-locked slots, the
# graphed update against the eager one, central inference); the learner alone, the actors alone together and the
# trainer with all cores, inference in the actors and central, each row's share of what its actors step alone;
# then the README's Pong command for 200 s: its time to a mean of 18 (the first progress line at 18 or more) and
# its median agent steps/s per interval. Seven files come back: the device tool returns at most eight.
if [ "$what" = targets ]; then
  runs=${RUNS:-/tmp/gpu-runs}
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
    -k "page_locked or straight_to_the_gpu or graphed_update_computes or central_inference_on_the_gpu or sampled_on_the_gpu" \
    > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc $?" >> "$out/pytest_gpu.txt"
  timeout 240 python3 -m impala.bench --num_actors auto --total_steps "${2:-300000}" --seconds 8 \
    --only env,learner,actors,e2e --variants "--inference actor " "--inference central " \
    --json "$out/targets.json" > "$out/targets.txt" 2>&1
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  pong_for 200 pong ${EXTRA:-}
  tail -n 4 "$out/pytest_gpu.txt"  # the bench's table without the JSON after it, or the end of a failed run
  if grep -q '^{' "$out/targets.txt"; then sed -n '1,/^{/p' "$out/targets.txt"; else tail -n 25 "$out/targets.txt"; fi
  cat "$out/pong.txt"
  exit 0
fi
# The README's Pong command for 200 s each, as it is and with $EXTRA (e.g. EXTRA="--num_actors 15"), one after
# the other in one call: each one's time to a mean of 18 and median agent steps/s. First, the default learner alone
# (its agent steps/s and operations per gradient step), under a minute.
if [ "$what" = pong_ab ]; then
  runs=${RUNS:-/tmp/gpu-runs}
  timeout 90 python3 -m impala.bench --only learner --seconds 10 > "$out/learner_graph.txt" 2>&1  # its JSON too: 8 files
  grep -E "^learner " "$out/learner_graph.txt" || tail -n 5 "$out/learner_graph.txt"
  pong_for 200 pong
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  pong_for 200 pong_extra ${EXTRA:-}
  cat "$out/pong.txt" "$out/pong_extra.txt"
  exit 0
fi
# The default settings in four parts, each within one 10-minute device call.
if [ "$what" = tests ]; then
  timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc $?" >> "$out/pytest_gpu.txt"
  tail -n 8 "$out/pytest_gpu.txt"
  exit 0
fi
if [ "$what" = learner ]; then
  timeout 60 python3 -m impala.bench --only learner --seconds 10 --no-cuda_graph \
    --json "$out/learner.json" > "$out/learner.txt" 2>&1
  timeout 60 python3 -m impala.bench --only learner --seconds 10 --no-pin_slots \
    --json "$out/learner_graph_stacked.json" > "$out/learner_graph_stacked.txt" 2>&1
  timeout 180 python3 -m impala.bench --only learner --seconds 10 --no-cuda_graph --compile \
    --json "$out/learner_compile.json" > "$out/learner_compile.txt" 2>&1
  timeout 60 python3 -m impala.bench --only learner --seconds 10 \
    --json "$out/learner_graph.json" > "$out/learner_graph.txt" 2>&1
  timeout 180 python3 -m impala.bench --only learner --seconds 10 --compile \
    --json "$out/learner_graph_compile.json" > "$out/learner_graph_compile.txt" 2>&1
  tail -n 8 "$out"/*.txt
  exit 0
fi
if [ "$what" = defaults ]; then
  timeout 560 python3 -m impala.bench --num_actors auto --total_steps "$steps" --seconds 5 \
    --only env,inference,learner,actor,actors,e2e --variants "--inference actor" "--inference central" \
    --json "$out/defaults.json" > "$out/defaults.txt" 2>&1
  tail -n 20 "$out"/*.txt
  exit 0
fi
# The trainer's default with one GPU-learner default undone each: the fewest slots that cannot deadlock
# (--num_actors auto's actors x 8 envs + one batch of 32, the default before a GPU learner's two unrolls of slots
# per env), and the observations stacked on the host (--no-pin_slots).
if [ "$what" = ablations ]; then
  fewest=$(( ($(nproc) - 2) * 8 + 32 ))
  timeout 560 python3 -m impala.bench --num_actors auto --total_steps "$steps" --only e2e \
    --variants "--inference actor --num_buffers $fewest" "--inference actor --no-pin_slots" \
    --json "$out/ablations.json" > "$out/ablations.txt" 2>&1
  tail -n 20 "$out/ablations.txt"
  exit 0
fi
# What could lift the trainer past its actors' pace, each against the default in the same call: central inference
# with two env splits (an actor steps one half of its envs while the other half waits for actions from the GPU),
# 16 envs per actor (a bigger, cheaper forward in each actor), both, and central inference with two env splits on 16
# actors instead of auto's 14 (an actor that only steps envs leaves room for more); then the README's Pong command for
# 200 s with $PLACEMENT (default: central inference, two env splits): its time to a mean of 18 and its median rate.
# About 7.5 minutes at the default 300,000 steps a row.
if [ "$what" = placement ]; then
  runs=${RUNS:-/tmp/gpu-runs}
  timeout 300 python3 -m impala.bench --num_actors auto --total_steps "${2:-300000}" --only e2e \
    --variants "--inference actor " "--inference central --env_splits 2" "--inference actor --envs_per_actor 16" \
    "--inference central --envs_per_actor 16 --env_splits 2" "--inference central --env_splits 2 --num_actors 16" \
    --json "$out/placement.json" > "$out/placement.txt" 2>&1
  # shellcheck disable=SC2086  # $PLACEMENT is flags, split on purpose
  pong_for 200 pong_placement ${PLACEMENT:---inference central --env_splits 2}
  if grep -q '^{' "$out/placement.txt"; then sed -n '1,/^{/p' "$out/placement.txt"; else tail -n 25 "$out/placement.txt"; fi
  cat "$out/pong_placement.txt"
  exit 0
fi
# Central inference's forward replayed as CUDA graphs, and an actor's bfloat16 forward channels last: the gpu-marked
# central-inference tests; the server alone, every env split of 14 actors asking at once, graphed and eager
# (--no-cuda_graph); one actor's forward at batch 8, shallow net and ResNet; the trainer with inference in the actors
# and central with two env splits, $2 steps each (default 200,000). About 3.5 minutes.
if [ "$what" = inference ]; then
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -k central_inference > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc $?" >> "$out/pytest_gpu.txt"
  for graph in --cuda_graph --no-cuda_graph; do
    timeout 60 python3 -m impala.bench --only inference --inference central --num_actors 14 --env_splits 2 \
      --seconds 5 "$graph" 2>&1 | grep -E "^inference|Error" >> "$out/forwards.txt"
  done
  for model in shallow resnet; do
    timeout 60 python3 -m impala.bench --only inference --model "$model" --seconds 3 2>&1 \
      | grep -E "^inference|Error" >> "$out/forwards.txt"
  done
  timeout 200 python3 -m impala.bench --num_actors auto --total_steps "${2:-200000}" --only e2e \
    --variants "--inference actor " "--inference central --env_splits 2" --json "$out/inference.json" \
    > "$out/inference.txt" 2>&1
  tail -n 3 "$out/pytest_gpu.txt"; cat "$out/forwards.txt"
  if grep -q '^{' "$out/inference.txt"; then sed -n '1,/^{/p' "$out/inference.txt"; else tail -n 25 "$out/inference.txt"; fi
  exit 0
fi
# Central inference in 1, 2 and 4 threads (--inference_threads: several batches in flight, each thread with its own
# stream and weight copies): the gpu-marked central-inference tests (two graphed threads at once among them); the
# servers alone, every env split of 14 actors asking at once, in 1, 2 and 4 threads (do K threads answer more than
# one, or does the interpreter they share bind them?); then the trainer with two env splits in 1, 2 and 4 threads,
# and in one and two threads waiting 0.5 ms for more requests (two since a wait stopped waiting for the other thread's
# actors, 2026-11-30), against inference in the actors, $2 agent steps a row (default 300,000: some five 5-s intervals
# at the steady rate). About 5 minutes.
if [ "$what" = threads ]; then
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider \
    -k "inference_threads or central_inference or take_turns or failed_capture" \
    > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc $?" >> "$out/pytest_gpu.txt"
  tail -n 3 "$out/pytest_gpu.txt"
  for k in 1 2 4; do
    timeout 60 python3 -m impala.bench --only inference --inference central --num_actors 14 --env_splits 2 \
      --inference_threads "$k" --seconds 4 2>&1 | grep -E "^inference|Error" >> "$out/servers.txt"
  done
  cat "$out/servers.txt"
  timeout 540 python3 -m impala.bench --num_actors auto --total_steps "${2:-300000}" --only e2e \
    --variants "--inference actor " "--inference central --env_splits 2" \
    "--inference central --env_splits 2 --inference_threads 2" "--inference central --env_splits 2 --inference_threads 4" \
    "--inference central --env_splits 2 --inference_wait_ms 0.5" \
    "--inference central --env_splits 2 --inference_threads 2 --inference_wait_ms 0.5" \
    --json "$out/threads.json" > "$out/threads.txt" 2>&1
  if grep -q '^{' "$out/threads.txt"; then sed -n '1,/^{/p' "$out/threads.txt"; else tail -n 25 "$out/threads.txt"; fi
  exit 0
fi
# run.py's own process at one torch thread (the tree since 7571e88) against 16, torch's default on these machines and
# what every GPU run before that commit had: the trainer end to end with inference in the actors, then central with
# two env splits, each at 1 and at 16, $2 agent steps a row (default 300,000). A sitecustomize.py on PYTHONPATH makes
# run.py's own torch.set_num_threads (in `training.build`) set $MAIN_THREADS instead; the actors and the fork server
# (other argv) keep theirs. About 3.5 minutes (estimated, not timed on a GPU).
if [ "$what" = main_threads ]; then
  forced=$(mktemp -d)
  cat > "$forced/sitecustomize.py" <<'PY'
import os
import sys

if os.environ.get("MAIN_THREADS") and sys.argv[:1] == ["run.py"]:
    import torch

    def _forced(_count: int, _set=torch.set_num_threads) -> None:
        _set(int(os.environ["MAIN_THREADS"]))
        print(f"run.py's torch threads: {torch.get_num_threads()} (MAIN_THREADS)", file=sys.stderr)

    torch.set_num_threads = _forced
PY
  # first the captures in two threads at once (`impala/cudagraphs.py`, since 6ea0a69; about 20 s)
  timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -k "take_turns or failed_capture or inference_threads or one_rank_joins or generator" \
    > "$out/pytest_gpu.txt" 2>&1
  echo "pytest rc $?" >> "$out/pytest_gpu.txt"
  tail -n 3 "$out/pytest_gpu.txt"
  for v in "--inference actor " "--inference central --env_splits 2"; do
    name=$(echo "$v" | tr -c 'a-z0-9\n' '_' | tr -s _)
    for threads in 1 16; do
      MAIN_THREADS=$([ "$threads" = 16 ] && echo 16) PYTHONPATH="$forced:${PYTHONPATH:-}" timeout 140 \
        python3 -m impala.bench --num_actors auto --total_steps "${2:-300000}" --only e2e --variants "$v" \
        > "$out/main_threads_$threads$name.txt" 2>&1
      echo "run.py at $threads thread(s):"
      grep -E "^bench: end to end .* in |logged by the run|the run fell back|Error" "$out/main_threads_$threads$name.txt" \
        || tail -n 5 "$out/main_threads_$threads$name.txt"
    done
  done
  exit 0
fi
# Where the main process's threads spend a run (the README's Pong command with $PROFILE, default central inference
# with two env splits): after 40 s, py-spy samples its threads for 15 s, idle included, then for 10 s only the thread
# holding the GIL (--gil), then 10 s with native frames; scripts/pyspy_summary.py gives each thread's innermost
# frames, and the run's logs.csv its server's ms per batch and their parts. .whl needs py-spy: ../shared/tools/gpu-wheels.sh py-spy==0.4.3.
# About 1.7 minutes.
if [ "$what" = profile ]; then
  runs=${RUNS:-/tmp/gpu-runs}
  spy=${PYSPY:-$(command -v py-spy || echo /tmp/site/bin/py-spy)}
  rm -rf "${runs:?}/profile"
  # shellcheck disable=SC2086  # $PROFILE is flags, split on purpose
  python3 run.py --env PongNoFrameskip-v4 --savedir "$runs" --xpid profile ${PROFILE:---inference central --env_splits 2} \
    > /dev/null 2>&1 &
  pid=$!
  sleep "${PROFILE_AFTER_S:-40}"
  "$spy" record -p "$pid" -d 15 -r 200 --threads --idle --format raw -o "$out/profile_idle.txt" > "$out/pyspy.txt" 2>&1
  "$spy" record -p "$pid" -d 10 -r 200 --threads --gil --format raw -o "$out/profile_gil.txt" >> "$out/pyspy.txt" 2>&1
  # native frames too: a thread waiting for the GIL shows take_gil, one waiting for the GPU the CUDA call it is in
  "$spy" record -p "$pid" -d 10 -r 100 --threads --idle --native --format raw -o "$out/profile_native.txt" \
    >> "$out/pyspy.txt" 2>&1
  kill -INT "$pid"; wait "$pid"
  cp "$runs/profile/logs.csv" "$out/profile_logs.csv"
  { echo "== every sample (idle included)"; python3 scripts/pyspy_summary.py "$out/profile_idle.txt" 3 10
    echo "== holding the GIL"; python3 scripts/pyspy_summary.py "$out/profile_gil.txt" 3 10
    echo "== native frames, idle included"; python3 scripts/pyspy_summary.py "$out/profile_native.txt" 6 8
  } > "$out/profile.txt" 2>&1
  python3 - "$out/profile_logs.csv" >> "$out/profile.txt" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))[2:]
for key in ("charts/SPS", "timing/inference_batch_ms", "timing/inference_forward_ms", "timing/inference_slots_ms",
            "stats/inference_actors_per_batch", "stats/inference_busy_share", "actors/policy_share", "actors/env_share"):
    values = [float(row[key]) for row in rows if row.get(key)]
    print(f"{key}: median {statistics.median(values):.3f} over {len(values)} intervals" if values else f"{key}: none")
PY
  tail -n 3 "$out/pyspy.txt"; cut -c1-250 "$out/profile.txt"
  exit 0
fi
# The README's Pong command with $EXTRA for $PONG_S seconds (default 200): the time to a mean of 18 and the median
# rate, against the issue's three minutes (EXTRA="--inference central --env_splits 2 --inference_threads 2", say).
# First the learner alone with the same flags (under a minute): what a change to the learning rule
# (EXTRA="--minibatches 16") costs the learner's agent steps/s.
if [ "$what" = pong200 ]; then
  runs=${RUNS:-/tmp/gpu-runs}
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  timeout 90 python3 -m impala.bench --only learner --seconds 10 ${EXTRA:-} > "$out/pong200_learner.txt" 2>&1
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  pong_for "${PONG_S:-200}" pong200 ${EXTRA:-}
  grep -E "^learner " "$out/pong200_learner.txt" || tail -n 5 "$out/pong200_learner.txt"
  cat "$out/pong200.txt"
  exit 0
fi
if [ "$what" = pong ]; then
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  timeout 420 python3 run.py --env PongNoFrameskip-v4 --savedir "$out/runs" --xpid pong ${EXTRA:-} > "$out/pong.txt" 2>&1
  timeout 120 python3 scripts/results.py pong --plot-only --savedir "$out/runs" --xpid pong >> "$out/pong.txt" 2>&1
  tail -n 8 "$out"/*.txt
  exit 0
fi
# What an actor's bfloat16 forward runs on this machine's CPU (the GPU machines' Xeons have AMX, the development VMs
# do not): oneDNN's kernels for the inference component (ONEDNN_VERBOSE), and the torso's forward at batch 8, one
# thread, with frames and weights as they are (NCHW), channels last, and in float32 (--no-amp); and what an actor's
# start costs: making its 8 Pong envs, then their seeded first reset (each loads the ROM again). Under a minute.
if [ "$what" = onednn ]; then
  ONEDNN_VERBOSE=1 timeout 60 python3 -m impala.bench --only inference --seconds 1 2>&1 | grep -v "^onednn_verbose" \
    > "$out/onednn.txt"  # the bench's lines; oneDNN's first 60 below them (one forward's are about 20)
  ONEDNN_VERBOSE=1 timeout 60 python3 -m impala.bench --only inference --seconds 0.2 2>&1 | grep "^onednn_verbose" \
    | head -n 60 >> "$out/onednn.txt"
  timeout 120 python3 - > "$out/layouts.txt" 2>&1 <<'PY'
import copy, time
import torch
from impala.model import CastTorso, Net
torch.set_num_threads(1)
model = Net((4, 84, 84), 6, "shallow").eval()  # float32: what an actor acts with under --no-amp
net = CastTorso(model, torch.bfloat16).refresh(0)
last = copy.deepcopy(net)
last.torso.to(memory_format=torch.channels_last)
obs = torch.randint(0, 255, (1, 8, 4, 84, 84), dtype=torch.uint8)
obs_last = obs[0].contiguous(memory_format=torch.channels_last)[None]
done = torch.zeros(1, 8, dtype=torch.bool)
def forward(model, frames, bf16=True):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(frames, done)[0].policy_logits
def cpu_ms(model, frames, bf16=True, calls=300):
    for _ in range(20):
        forward(model, frames, bf16)
    start = time.process_time()
    for _ in range(calls):
        forward(model, frames, bf16)
    return 1000 * (time.process_time() - start) / calls
for round_ in range(3):
    print(f"round {round_}: CPU-ms per forward at batch 8, bfloat16 NCHW {cpu_ms(net, obs):.3f}, bfloat16 channels "
          f"last {cpu_ms(last, obs_last):.3f}, float32 (channels last, as --no-amp acts) {cpu_ms(model, obs, False):.3f}")
print("largest logit difference", (forward(net, obs) - forward(last, obs_last)).abs().max().item())
from impala.environment import EnvBatch
for round_ in range(2):
    start = time.process_time()
    env = EnvBatch("PongNoFrameskip-v4", 8, list(range(8)))
    made = time.process_time()
    env.reset()
    print(f"8 Pong envs: made in {made - start:.3f} CPU-s, first (seeded) reset {time.process_time() - made:.3f}")
    env.close()
PY
  grep -m 12 "exec" "$out/onednn.txt" | cut -c1-220
  grep "^inference " "$out/onednn.txt"
  cat "$out/layouts.txt"
  exit 0
fi
# Where an actor's time goes on this machine's cores, and what each actor-side option buys: one actor alone
# and `--num_actors auto` actors together (`actor`, `actors`), as the defaults have them, then with one option
# changed each: float32 acting (--no-amp), two env splits, 16 envs per actor.
if [ "$what" = actors ]; then
  for v in "" "--no-amp" "--env_splits 2" "--envs_per_actor 16"; do
    name=$(echo "base $v" | tr -c 'a-z0-9\n' '_' | tr -s _)
    # shellcheck disable=SC2086  # $v is flags, split on purpose
    timeout 140 python3 -m impala.bench --num_actors auto --only env,inference,actor,actors --seconds 5 $v \
      --json "$out/actors$name.json" > "$out/actors$name.txt" 2>&1
  done
  grep -h -E "^(env|inference|actor|actors) " "$out"/actors*.txt
  exit 0
fi
# One Atari-5 game with all cores, 9 minutes per call (a device call lasts at most 10): rerun it while the
# machine is warm to resume the run in results/runs; the game's kept record comes back in $OUT/atari5, to
# copy into docs/results/atari5. GAME=DoubleDunk (default Phoenix). A candidate change to the defaults:
# EXTRA="--minibatch_mode samples" XPID=atari5-samples (its runs and records named apart from the defaults').
if [ "$what" = atari5 ]; then
  # shellcheck disable=SC2086  # $EXTRA is flags, split on purpose
  timeout 590 python3 scripts/results.py atari5 --games "${GAME:-Phoenix}" --minutes 9 --keep "$out/atari5" \
    --xpid "${XPID:-atari5}" ${EXTRA:-} > "$out/atari5.txt" 2>&1
  tail -n 12 "$out/atari5.txt"
  exit 0
fi
if [ "$what" != e2e ]; then
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc $?" >> "$out/pytest_gpu.txt"
timeout 75 python3 -m impala.bench --only learner --model resnet --batch_size 32 --seconds 20 \
  --json "$out/resnet_learner.json" > "$out/resnet_learner.txt" 2>&1
fi
common=(--num_actors 14 --envs_per_actor 16 --batch_size 32 --total_steps "$steps")
if [ "$what" != e2e ]; then
timeout 90 python3 -m impala.bench "${common[@]}" --only env,inference,learner,actor --seconds 5 \
  --json "$out/shallow_components.json" > "$out/shallow_components.txt" 2>&1
fi
[ "$what" = parts ] && { tail -n 5 "$out"/*.txt; exit 0; }
for v in "--inference actor" "--inference central" "--inference central --env_splits 2"; do
  name=$(echo "$v" | tr -c 'a-z0-9\n' '_' | tr -s _)
  timeout 170 python3 -m impala.bench "${common[@]}" --only e2e --variants "$v" \
    --json "$out/e2e$name.json" > "$out/e2e$name.txt" 2>&1
done
tail -n 5 "$out"/*.txt
