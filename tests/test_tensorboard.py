"""One short CartPole run (through `run.py`, stdout piped to a file), then what it left behind: the tag
groups in its event files, a real TensorBoard server serving them, the run directory, the console log,
a test-mode video and a plot of the learning curve."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image
from process_helpers import IMPALA_RULE
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from impala import plotting
from impala.config import parse_config
from impala.rundir import prepare_run_directory, run_directory, write_run_files

REPO = Path(__file__).resolve().parent.parent
TOTAL_STEPS = 20_000
STEPS_PER_UPDATE = 5 * 8  # unroll_length x batch_size below
TRAIN_FLAGS = ["--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "4", "--unroll_length", "5",
               "--batch_size", "8", "--learning_rate", "0.001", *IMPALA_RULE, "--entropy_cost", "0.01",
               "--total_steps", str(TOTAL_STEPS), "--log_interval_s", "1", "--checkpoint_interval_s", "600"]

EXPECTED_TAGS = {
    "charts": ["episodic_return", "episodic_length", "SPS", "learning_rate", "frames"],
    "losses": ["total_loss", "pg_loss", "baseline_loss", "entropy_loss"],
    "stats": ["grad_norm", "policy_lag", "rho_mean", "rho_clipped_fraction", "full_queue_size", "free_queue_size"],
    "timing": ["wait_batch_ms", "host_to_device_ms", "stack_ms", "forward_backward_ms", "publish_ms"],
    "actors": ["slot_wait_share", "policy_share", "env_share", "write_share"],
}
ALL_TAGS = [f"{group}/{name}" for group, names in EXPECTED_TAGS.items() for name in names]
BROKEN_TENSORFLOW = "a TensorFlow whose import fails"


@dataclass
class TrainedRun:
    savedir: Path
    run_dir: Path
    stdout: str
    events: EventAccumulator


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> TrainedRun:
    savedir = tmp_path_factory.mktemp("runs")
    stdout_path = savedir / "stdout.txt"
    # A user's environment may hold a TensorFlow, here one whose import fails: the run must never import it.
    site = tmp_path_factory.mktemp("site")
    (site / "tensorflow").mkdir()
    (site / "tensorflow" / "__init__.py").write_text(f"raise RuntimeError({BROKEN_TENSORFLOW!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    with open(stdout_path, "w") as stdout:  # a file, not a terminal: plain progress lines expected
        subprocess.run([sys.executable, "run.py", *TRAIN_FLAGS, "--savedir", str(savedir), "--xpid", "cartpole"],
                       cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, timeout=180, check=True)
        subprocess.run([sys.executable, "run.py", "--mode", "test", "--env", "CartPole-v1", "--savedir", str(savedir),
                        "--xpid", "cartpole", "--test_episodes", "2", "--video"],
                       cwd=REPO, env=env, stdout=stdout, stderr=subprocess.STDOUT, timeout=120, check=True)
    run_dir = savedir / "cartpole"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return TrainedRun(savedir, run_dir, stdout_path.read_text(), events)


def test_every_tag_group_has_values_against_agent_steps(trained: TrainedRun) -> None:
    scalars = trained.events.Tags()["scalars"]
    missing = [tag for tag in ALL_TAGS if tag not in scalars]
    assert not missing, f"missing tags {missing}; present: {scalars}"
    assert "timing/vote_ms" not in scalars  # torchrun's alone
    for tag in ALL_TAGS:
        events = trained.events.Scalars(tag)
        steps = [e.step for e in events]
        assert events, tag
        assert all(0 <= s <= TOTAL_STEPS and s % STEPS_PER_UPDATE == 0 for s in steps), (tag, steps)


def test_a_broken_tensorflow_installed_beside_it_is_never_imported(trained: TrainedRun) -> None:
    # The fixture's training and test runs had it first on their path: both ran to their end (a traceback would
    # have failed the fixture) and wrote their events (here and in the test-mode test), without its error.
    assert BROKEN_TENSORFLOW not in trained.stdout
    assert trained.events.Scalars("charts/episodic_return")


def test_scalar_values_mean_what_their_names_say(trained: TrainedRun) -> None:
    def values(tag: str) -> list[float]:
        found = [e.value for e in trained.events.Scalars(tag)]
        assert found, f"no {tag} written"  # else every check on it below holds of nothing
        return found

    assert values("charts/frames") and all(e.value == e.step for e in trained.events.Scalars("charts/frames"))  # frame skip 1 off Atari
    assert all(0 < v <= 0.001 for v in values("charts/learning_rate"))  # decays linearly from --learning_rate
    assert all(0 <= v <= 1 for v in values("stats/rho_clipped_fraction"))
    assert all(v > 0 for v in values("stats/rho_mean"))
    assert all(v >= 0 for v in values("stats/policy_lag"))
    assert all(v >= 0 for tag in ALL_TAGS if tag.startswith("timing/") for v in values(tag))
    shares = [values(f"actors/{name}") for name in EXPECTED_TAGS["actors"]]
    for interval in zip(*shares, strict=True):  # the actors' whole time, split between the phases
        assert all(0 <= share <= 1 for share in interval) and sum(interval) == pytest.approx(1)
    assert sum(values("actors/env_share")) > 0 and sum(values("actors/policy_share")) > 0
    slots = 2 * 2 * 4 + 2 * 8  # the default --num_buffers for these flags
    for tag in ("stats/full_queue_size", "stats/free_queue_size"):
        assert all(0 <= v <= slots and v == int(v) for v in values(tag)), tag
    lengths, returns = values("charts/episodic_length"), values("charts/episodic_return")
    assert len(lengths) == len(returns) > 0
    assert all(1 <= length <= 500 for length in lengths)
    assert sorted(lengths) == sorted(returns)  # CartPole pays 1 per step


def test_flags_are_in_tensorboard_as_text_and_hparams(trained: TrainedRun) -> None:
    text = trained.events.Tensors("flags/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| env | `CartPole-v1` |" in text and f"| total_steps | `{TOTAL_STEPS}` |" in text
    assert "_hparams_/session_start_info" in trained.events.PluginTagToContent("hparams")


def test_test_mode_writes_a_video_and_the_return_at_the_checkpoint_step(trained: TrainedRun) -> None:
    test_events = EventAccumulator(str(trained.run_dir / "test"), size_guidance={"scalars": 0, "images": 0})
    test_events.Reload()
    (video,) = test_events.Images("test/video")
    assert video.step == TOTAL_STEPS
    gif = Image.open(io.BytesIO(video.encoded_image_string))
    (mean_return,) = test_events.Scalars("test/episodic_return_mean")
    assert gif.format == "GIF" and gif.n_frames >= 8  # CartPole cannot fall in fewer steps
    assert mean_return.step == TOTAL_STEPS and mean_return.value >= 8
    assert "Wrote the first episode" in trained.stdout


def test_run_directory_explains_itself(trained: TrainedRun) -> None:
    run_dir = trained.run_dir
    assert (trained.savedir / "latest").read_text() == "cartpole\n"  # a file, not a symlink TensorBoard follows
    flags = json.loads((run_dir / "flags.json").read_text())
    assert flags["env"] == "CartPole-v1" and flags["total_steps"] == TOTAL_STEPS
    meta = json.loads((run_dir / "meta.json").read_text())
    assert {"python", "torch", "gymnasium", "ale_py", "git_commit", "starts"} <= set(meta)
    assert meta["end_reason"] == "finished" and meta["final_step"] == TOTAL_STEPS and meta["ended"]
    with open(run_dir / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and {"step", "charts/SPS", "charts/frames", "losses/total_loss", "timing/publish_ms"} <= set(rows[0])
    assert all(int(r["step"]) % STEPS_PER_UPDATE == 0 for r in rows) and rows[-1]["step"] == str(TOTAL_STEPS)
    assert (run_dir / "model.tar").is_file() and any(run_dir.glob("events.out.tfevents.*"))


def test_piped_console_log_is_plain_lines_one_per_interval(trained: TrainedRun) -> None:
    out_log = (trained.run_dir / "out.log").read_text()
    for text in (trained.stdout, out_log):
        assert "\r" not in text and "\x1b" not in text
    progress = [line for line in out_log.splitlines() if re.search(r"\] +[\d.]+%  step ", line)]
    assert progress, out_log
    assert all("SPS" in line and "elapsed" in line and "left" in line and "return" in line for line in progress)
    assert progress == [line for line in trained.stdout.splitlines() if line in progress]
    assert f"100.0%  step {TOTAL_STEPS:,}/{TOTAL_STEPS:,}" in progress[-1]  # the run's end is reported
    stamps = [line[:10] for line in progress[:-1]]
    assert len(stamps) == len(set(stamps))  # --log_interval_s 1: never two progress lines in one second


def test_plot_of_the_run_shows_its_learning_curve(trained: TrainedRun) -> None:
    out = trained.savedir / "returns.png"
    plotting.plot(parse_config(["--mode", "plot", "--savedir", str(trained.savedir), "--xpid", "cartpole",
                                "--plot_out", str(out)]))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = plotting.load_curve(trained.savedir, "cartpole")
    legend = plotting.returns_figure([curve]).axes[0].get_legend()
    # No evaluation while training; test mode's mean return is in test/, not drawn as one.
    assert [t.get_text() for t in legend.get_texts()] == ["cartpole"]
    smoothed = plotting.smooth(curve.returns, plotting.smoothing_window(len(curve.returns)))
    assert smoothed[-1] > 2 * smoothed[0]  # it learned: a random CartPole policy averages about 22


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _served(logdir: Path) -> tuple[dict, dict]:
    """A real TensorBoard server over `logdir`, once it has loaded something: its scalar tags per run
    ({run: {tag: ...}}) and its plugin listing."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
        deadline = time.monotonic() + 60
        tags: dict = {}
        while time.monotonic() < deadline and not tags:
            assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    tags = json.load(response)  # empty until the first load is done
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        assert tags, "TensorBoard did not answer within 60 s"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugins_listing", timeout=5) as response:
            return tags, json.load(response)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_tensorboard_server_serves_every_tag_group(trained: TrainedRun) -> None:
    tags, plugins = _served(trained.run_dir)
    assert sorted(tags) == [".", "test"]  # the run directory itself, and test mode's records beside its own
    run_tags = tags["."]
    missing = [tag for tag in ALL_TAGS if tag not in run_tags]
    assert not missing, f"served tags lack {missing}"
    assert all(plugins[name]["enabled"] for name in ("scalars", "images", "text", "hparams"))


def test_tensorboard_over_the_savedir_lists_each_run_once(tmp_path: Path) -> None:
    # the files a run writes beside itself (the `latest` marker) must not show up as a second run
    config = parse_config(["--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "only"])
    run_dir, resuming = run_directory(config)
    prepare_run_directory(run_dir)
    write_run_files(config, run_dir, resuming)
    with SummaryWriter(str(run_dir)) as writer:
        for step in range(3):
            writer.add_scalar("charts/episodic_return", 10.0 * step, step)
    tags, _ = _served(tmp_path)
    assert list(tags) == ["only"]


def test_sps_counts_the_steps_of_updates_slower_than_the_log_interval(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An update longer than --log_interval_s holds the lock the progress line waits for: the steps it adds
    go into the next line's SPS. Each row's SPS times its interval is the steps since the row before, and the
    interval is at least --log_interval_s, and the intervals together span no more than the run."""
    from impala import learner, training
    from impala.config import Config

    update_s, interval_s = 0.3, 0.1

    def slow_update_function(config: Config, device: object, world_size: int = 1) -> object:
        def slow_update(*args: object, **kwargs: object) -> dict[str, float]:
            time.sleep(update_s)
            return learner.update(*args, **kwargs)  # type: ignore[arg-type]
        return slow_update

    monkeypatch.setattr(learner, "update_function", slow_update_function)
    config = parse_config(["--env", "CartPole-v1", "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length",
                           "5", "--batch_size", "4", "--total_steps", "200", "--log_interval_s", str(interval_s),
                           "--hidden_size", "16", "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "slow"])
    start = time.monotonic()
    run_dir = training.train(config)
    train_s = time.monotonic() - start
    with open(run_dir / "logs.csv", newline="") as f:
        rows = [(int(row["step"]), float(row["charts/SPS"])) for row in csv.DictReader(f)]
    steps = [step for step, _ in rows]
    assert steps[-1] == 200 and steps == sorted(steps)
    previous, intervals_s = 0, 0.0
    for i, (step, sps) in enumerate(rows):
        counted = step - previous
        assert (sps > 0) == (counted > 0), rows
        if i < len(rows) - 1:  # the last line comes at the end, however soon after the one before
            assert sps <= counted / interval_s + 1e-9, rows
        intervals_s += counted / sps if counted else 0.0
        previous = step
    # The intervals follow each other within the run, so together they span no more than the run took: an SPS
    # taken over too long an interval (one that overlapped the one before) would show here, however loaded the
    # machine. Several intervals of updates slower than the log interval, and each of those updates counted.
    assert 3 * update_s <= intervals_s <= train_s, (intervals_s, train_s, rows)
    assert sum(1 for _, sps in rows if sps > 0) >= 3  # updates finished in several intervals, each counted


def test_the_progress_lines_elapsed_time_counts_from_the_programs_start(tmp_path: Path) -> None:
    """run.py hands the run the moment it started, so the elapsed time shown counts the start-up too (imports, the
    envs, the actors: seconds on a GPU machine); the console's SPS still counts only the run's own steps and time."""
    import run

    argv = ["--env", "CartPole-v1", "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length", "5",
            "--batch_size", "4", "--total_steps", "200", "--log_interval_s", "0.2", "--hidden_size", "16",
            "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "clock"]
    assert run.main(argv, started_s=time.monotonic() - 3600) == 0
    progress = [line for line in (tmp_path / "clock" / "out.log").read_text().splitlines() if " elapsed " in line]
    assert progress and all(re.search(r" elapsed 1:0\d:\d\d ", line) for line in progress), progress
    sps = int(re.search(r" SPS ([\d,]+) ", progress[-1]).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert sps >= 1, progress  # 200 steps over the run's seconds (at most 10 minutes here); over the hour before it, 0
