"""Steps/s against the number of actor processes, local and remote through Ray, as a PNG and JSON.

    python scripts/ray_scaling.py --actors 1 2 4 --total_steps 40000 --out docs/ray_scaling.png

Each point is one `run.py` training (the README's CartPole settings, 4 envs per actor process) whose whole
process tree is measured (`impala.bench.measure_process_tree`: with `--ray local` Ray's daemons and
workers are children of the run, so they are counted). Steps/s is the steady rate: the mean of the run's
logged SPS once every actor acts (start-up, which for Ray includes starting Ray, is left out); steps per
CPU-second divides the run's steps by all the CPU its tree used, start-up included.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.backend_bases import FigureCanvasBase

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from impala.bench import load_average, measure_process_tree

CARTPOLE = ("--env", "CartPole-v1", "--unroll_length", "5", "--batch_size", "8", "--learning_rate", "0.001",
            "--policy_loss", "impala", "--optimizer", "rmsprop", "--epsilon", "0.01", "--grad_norm_clipping", "40",
            "--epochs", "1", "--minibatches", "1", "--vtrace_lambda", "1", "--lr_schedule", "linear", "--log_interval_s", "2")
ENVS = 4


def actor_flags(kind: str, count: int) -> list[str]:
    if kind == "local":
        return ["--num_actors", str(count), "--envs_per_actor", str(ENVS)]
    return ["--num_actors", "0", "--ray", "local", "--ray_actors", str(count), "--ray_envs_per_actor", str(ENVS)]


def steady_sps(run_dir: Path) -> float:
    """Mean logged SPS after the first row with steps (start-up excluded), the last (partial) row left out."""
    rows = [row for row in csv.DictReader((run_dir / "logs.csv").open()) if int(row["step"]) > 0]
    rates = [float(row["charts/SPS"]) for row in rows[1:-1]] or [float(row["charts/SPS"]) for row in rows]
    return sum(rates) / len(rates) if rates else 0.0


def measure(kind: str, count: int, total_steps: int) -> dict[str, float | int | str]:
    with tempfile.TemporaryDirectory(prefix="impala-scaling-") as savedir:
        argv = [sys.executable, "run.py", *CARTPOLE, *actor_flags(kind, count), "--total_steps", str(total_steps),
                "--savedir", savedir, "--xpid", "scaling"]
        log = Path(savedir) / "output.log"
        usage = measure_process_tree(argv, cwd=REPO_ROOT, log_path=log)
        sps = steady_sps(Path(savedir) / "scaling") if usage.returncode == 0 else 0.0
        output = log.read_text(errors="replace").strip().splitlines()
    point: dict[str, float | int | str] = {"kind": kind, "actors": count, "returncode": usage.returncode, "steps_per_s": sps,
             "steps_per_cpu_s": total_steps / usage.cpu_s if usage.cpu_s else 0.0, "wall_s": usage.wall_s,
             "cpu_s": usage.cpu_s, "command": " ".join(argv[1:])}
    if usage.returncode != 0:
        last = output[-1] if output else "no output"
        print(f"ray_scaling: {kind} x{count}: run.py exited with {usage.returncode}: {last}", file=sys.stderr)
    else:
        print(f"ray_scaling: {kind} x{count}: {sps:.0f} steps/s, {point['steps_per_cpu_s']:.0f} steps/CPU-s",
              file=sys.stderr)
    return point


def plot(points: list[dict], out: Path, title: str) -> None:
    figure, axes = plt.subplots(figsize=(6, 4))
    for kind, marker in (("local", "o"), ("ray", "s")):
        mine = [p for p in points if p["kind"] == kind]
        axes.plot([p["actors"] for p in mine], [p["steps_per_s"] for p in mine], marker=marker,
                  label="local actor processes" if kind == "local" else "remote actors (--ray local)")
    axes.set_xlabel("actor processes")
    axes.set_ylabel("agent steps / s (steady)")
    axes.set_xscale("log", base=2)
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=9)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--kinds", nargs="+", default=["local", "ray"], choices=["local", "ray"])
    parser.add_argument("--total_steps", type=int, default=40_000)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "ray_scaling.png")
    args = parser.parse_args()
    if min(args.actors) < 1 or args.total_steps < 1:
        parser.error(f"--actors and --total_steps take numbers >= 1, got --actors {' '.join(map(str, args.actors))} "
                     f"--total_steps {args.total_steps}")
    formats = FigureCanvasBase.get_supported_filetypes()
    if args.out.suffix.lstrip(".").lower() not in formats:
        parser.error(f"--out {args.out}: name a figure file ({', '.join('.' + name for name in sorted(formats))})")
    if not os.access(args.out.resolve().parent, os.W_OK):
        parser.error(f"--out {args.out}: its directory does not exist or cannot be written")
    if "ray" in args.kinds and importlib.util.find_spec("ray") is None:
        parser.error("--kinds ray needs Ray (pip install -r requirements-ray.txt); --kinds local measures without it")
    load_start = load_average()
    points = [measure(kind, count, args.total_steps) for count in args.actors for kind in args.kinds]
    if failed := [p for p in points if p["returncode"] != 0]:  # a figure of zeros would replace the last one
        print(f"ray_scaling: {len(failed)} of {len(points)} runs failed (above); {args.out} left as it was",
              file=sys.stderr)
        return 1
    title = (f"CartPole, {ENVS} envs per actor process, {args.total_steps} steps per point\n"
             f"{os.cpu_count()} cores, load average {load_start[0]:.1f} at start")
    try:
        plot(points, args.out, title)
        args.out.with_suffix(".json").write_text(json.dumps({"load_average_start": load_start,
                                                             "load_average_end": load_average(),
                                                             "points": points}, indent=2) + "\n")
    except OSError as exc:
        print(f"ray_scaling: cannot write {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"ray_scaling: wrote {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
