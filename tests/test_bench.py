"""The benchmark: its JSON for a tiny config, the ceiling arithmetic, and CPU time of a whole process tree."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from process_helpers import REPO_ROOT, children, runs_started_by, sigterm_to_it_alone, wait_until_gone

from impala import bench, distributed, learner, vtrace
from impala.config import Config, usable_cores
from impala.model import Net

RATE_KEYS = {"steps", "wall_s", "cpu_s", "steps_per_s", "steps_per_cpu_s", "cpu_ms_per_step"}


@pytest.fixture(scope="module")
def micro_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "results.json"
    threads = torch.get_num_threads()
    code = bench.main(["--env", "CartPole-v1", "--unroll_length", "5", "--seconds", "0.3", "--env_splits", "2",
                       "--only", "env,inference,learner,actor,actors", "--json", str(path)])
    assert code == 0
    assert torch.get_num_threads() == threads  # the bench restores the thread count it changes
    return json.loads(path.read_text())


def test_micro_benchmarks_report_every_component_with_consistent_rates(micro_results: dict) -> None:
    assert set(micro_results["components"]) == {"env", "inference", "learner", "actor", "actors"}
    for name, component in micro_results["components"].items():
        assert RATE_KEYS <= set(component), name
        assert component["steps"] > 0 and component["wall_s"] > 0 and component["cpu_s"] > 0, name
        assert component["steps_per_s"] == pytest.approx(component["steps"] / component["wall_s"])
        assert component["steps_per_cpu_s"] == pytest.approx(component["steps"] / component["cpu_s"])
    components = micro_results["components"]
    assert components["env"]["steps"] % 4 == 0  # whole steps of one split: 8 envs in 2 splits
    assert components["inference"]["batch"] == 4 and components["inference"]["threads"] == 1
    assert components["actor"]["steps"] % 5 == 0 and components["actor"]["splits"] == 2  # T per slot
    shares = components["actor"]["phase_shares"]  # of the timed window: its own, without start-up
    assert set(shares) == {"slot_wait", "policy", "env", "write"} and sum(shares.values()) == pytest.approx(1)
    assert shares["policy"] > 0 and shares["env"] > 0
    assert components["learner"]["steps"] % (5 * 8) == 0  # T * B per update
    assert components["learner"]["operations_per_gradient_step"] > 50  # forward, losses, backward, Adam
    phases = components["learner"]["median_ms_per_batch"]  # stack, copy, update: within one call's wall time
    assert set(phases) == {"stack", "copy", "update"} and all(ms >= 0 for ms in phases.values())
    assert phases["update"] > 0 and sum(phases.values()) < 1000.0 * components["learner"]["wall_s"]
    actors = components["actors"]  # --num_actors 2 at once, each its own process; the sums of theirs
    assert actors["actors"] == 2 and len(actors["per_actor_steps_per_s"]) == 2
    assert actors["steps_per_s"] == pytest.approx(sum(actors["per_actor_steps_per_s"]))
    assert all(rate > 0 for rate in actors["per_actor_steps_per_s"])
    assert actors["steps"] % 5 == 0 and sum(actors["phase_shares"].values()) == pytest.approx(1)
    assert micro_results["end_to_end"] == []
    assert micro_results["config"]["env"] == "CartPole-v1" and micro_results["config"]["num_actors"] == 2
    machine = micro_results["machine"]
    assert machine["cores_usable"] >= 1 and machine["cpu"] and machine["torch"] == torch.__version__
    assert len(micro_results["load_average_start"]) == 3


def _operations_per_gradient_step(unroll_length: int) -> float:
    """The bench's count for the default rule (PPO, 2 passes x min(8, B) minibatches) on CartPole's MLP, B = 4."""
    config = Config(env="CartPole-v1", unroll_length=unroll_length, batch_size=4, disable_cuda=True)
    shape = bench.EnvShape((4,), torch.float32, 2, "mlp")
    model = Net(shape.observation_shape, shape.num_actions, "mlp", False, 8)
    optimizer, scheduler = learner.make_optimizer(model, config)
    slots = bench._synthetic_slots(config, shape, model)
    staging = learner.BatchStaging(slots, config.batch_size, pin=False)
    staging.fill(list(range(config.batch_size)))
    batch, core_state = staging.to(torch.device("cpu"))
    learner.update(model, optimizer, scheduler, batch, core_state, config)  # the optimiser's state, made once
    return bench.operations_per_gradient_step(model, optimizer, scheduler, batch, core_state, config, amp=False)


def test_a_gradient_step_launches_as_many_operations_for_any_unroll_length_with_the_gpus_sums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What keeps a GPU learner from being bound by launches as T grows: with V-trace's sums as a GPU forms them
    (`vtrace.as_matrix`), no operation of a gradient step is repeated per time step; the CPU's scan by doubling
    adds a round of a few operations each time T doubles."""
    monkeypatch.setattr(vtrace, "as_matrix", lambda deltas: True)
    assert _operations_per_gradient_step(16) == _operations_per_gradient_step(64) > 50
    monkeypatch.setattr(vtrace, "as_matrix", lambda deltas: False)
    assert _operations_per_gradient_step(64) - _operations_per_gradient_step(16) == 2 * 5  # two rounds of five


def test_ceiling_is_the_sum_of_cpu_per_step_times_the_cores(micro_results: dict) -> None:
    limit = micro_results["ceiling"]
    assert limit["cores"] == usable_cores()  # the affinity's, fewer under a cgroup quota
    assert limit["steps_per_s"] == pytest.approx(limit["steps_per_cpu_s"] * limit["cores"])


def test_the_central_inference_component_serves_every_actors_env_split_through_the_server() -> None:
    config = Config(env="CartPole-v1", num_actors=3, envs_per_actor=4, env_splits=2, inference="central",
                    disable_cuda=True)
    result = bench.bench_inference(config, bench.EnvShape((4,), torch.float32, 2, "mlp"), seconds=0.05)
    assert result["batch"] == 12 and result["device"] == "cpu" and not result["graphed"]
    assert "6 clients x 2 envs (central thread)" in result["what"]
    assert result["steps"] > 0 and result["steps"] % 12 == 0  # whole batches, every client answered each time


def test_the_central_inference_component_with_two_threads_serves_each_ones_share_at_once() -> None:
    config = Config(env="CartPole-v1", num_actors=3, envs_per_actor=4, env_splits=2, inference="central",
                    inference_threads=2, disable_cuda=True)
    result = bench.bench_inference(config, bench.EnvShape((4,), torch.float32, 2, "mlp"), seconds=0.05)
    assert result["batch"] == 12 and result["inference_threads"] == 2
    assert "6 clients x 2 envs (2 central threads)" in result["what"]
    assert result["steps"] > 0 and result["steps"] % 6 == 0  # each server's 3 clients x 2 envs, all answered each time


def test_the_concurrent_loop_counts_every_threads_steps_and_each_ran_at_once() -> None:
    running: set[str] = set()
    overlapped = threading.Event()
    calls = {"a": 0, "b": 0}

    def step(name: str, steps: int) -> Callable[[], int]:
        def call() -> int:
            running.add(name)
            if len(running) == 2:
                overlapped.set()
            time.sleep(0.002)
            calls[name] += 1
            running.discard(name)
            return steps
        return call

    rate = bench._concurrent_loop([step("a", 1), step("b", 1000)], seconds=0.1)
    assert overlapped.is_set() and rate.wall_s >= 0.1
    # the steps are a's timed calls plus a thousand times b's (0.1 s holds far fewer than 1,000 calls of 2 ms)
    timed = {"a": rate.steps % 1000, "b": rate.steps // 1000}
    for name in ("a", "b"):  # each timed at least MIN_CALLS times; its three warm-up calls not counted
        assert bench.MIN_CALLS <= timed[name] <= calls[name] - 3


def test_the_concurrent_loop_raises_what_a_thread_raised() -> None:
    def fails() -> int:
        raise RuntimeError("the inference server answered 0 of 3 clients")

    with pytest.raises(RuntimeError, match="answered 0 of 3"):
        bench._concurrent_loop([lambda: 1, fails], seconds=0.05)


def test_ceiling_worked_by_hand() -> None:
    # env 1 ms + inference 2 ms + learner 5 ms of CPU per agent step = 8 ms: 125 steps per CPU-second,
    # 375 steps/s on 3 cores. The actor row (env and inference together) is not part of the sum.
    components = {"env": {"steps_per_cpu_s": 1000.0}, "inference": {"steps_per_cpu_s": 500.0, "device": "cpu"},
                  "learner": {"steps_per_cpu_s": 200.0, "steps_per_s": 180.0},
                  "actor": {"steps_per_cpu_s": 1.0}}
    assert bench.ceiling(components, 3) == {"cpu_ms_per_step": pytest.approx(8.0), "steps_per_cpu_s": pytest.approx(125.0),
                                            "cores": 3, "steps_per_s": pytest.approx(375.0)}
    components["learner"]["cpu_is_host_only"] = True  # a GPU learner: its device time is not CPU time
    assert "180 steps/s" in bench.ceiling(components, 3)["note"]


def test_fractions_of_the_ceiling_worked_by_hand() -> None:
    limit = {"steps_per_cpu_s": 125.0, "steps_per_s": 375.0}
    row = bench.add_fractions({"steps_per_cpu_s": 100.0, "steps_per_s": 150.0}, limit)
    assert row["fraction_of_ceiling_cpu"] == pytest.approx(0.8)  # 100 / 125
    assert row["fraction_of_ceiling_wall"] == pytest.approx(0.4)  # 150 / 375
    assert bench.add_fractions({"steps_per_s": 1.0}, None) == {"steps_per_s": 1.0}  # no ceiling measured


def test_the_env_only_ceiling_and_a_rows_share_of_it_worked_by_hand() -> None:
    # 1,000 env steps per CPU-second on 16 cores: 16,000 steps/s; a run at 12,000 steps/s reaches 75% of it.
    assert bench.env_ceiling({"env": {"steps_per_cpu_s": 1000.0}}, 16) == pytest.approx(16_000.0)
    assert bench.env_ceiling({}, 16) is None  # no env component measured
    row = bench.add_fractions({"steps_per_cpu_s": 100.0, "steps_per_s": 12_000.0}, None, 16_000.0)
    assert row["fraction_of_env_ceiling"] == pytest.approx(0.75)


def test_a_rows_share_of_what_its_actors_step_alone_worked_by_hand() -> None:
    # 14 actors stepping 15,000 steps/s together with no learner; the trainer at 12,000 steps/s reaches 80%.
    row = bench.add_fractions({"steps_per_cpu_s": 100.0, "steps_per_s": 12_000.0}, None, None, 15_000.0)
    assert row == {"steps_per_cpu_s": 100.0, "steps_per_s": 12_000.0, "fraction_of_actors_alone": pytest.approx(0.8)}
    row.update({"variant": "", "returncode": 0, "steps": 300, "wall_s": 1.0, "cpu_s": 2.0, "peak_pss_mib": 10.0,
                "cpu_s_by_depth": [1.0], "monitor_cpu_s": 0.1, "cwd": ".", "command": "run.py"})
    text = bench.format_table({"machine": {"cpu": "x", "cores_usable": 16, "torch": "t", "device": "cpu"},
                               "load_average_start": [0.0, 0.0, 0.0], "wall_provisional": False,
                               "components": {"actors": {"actors": 14, "steps_per_s": 15_000.0, "steps_per_cpu_s": 1.0,
                                                         "cpu_ms_per_step": 1.0, "what": "14 actors"}},
                               "ceiling": None, "end_to_end": [row]})
    assert "  80% of what 14 actors step alone together (15000 steps/s)" in text.splitlines()
    assert bench.row_summary(row) == "300 steps in 1.0 s, 12,000 steps/s, 100 steps/CPU-s, 80% of its actors alone"


def test_a_rows_steady_rate_is_its_median_interval_after_the_first_two(tmp_path: Path) -> None:
    """Start-up slows a short run's first intervals: the steady rate leaves the first two out, and its share of
    what the actors step alone is given beside the whole run's."""
    (tmp_path / "logs.csv").write_text("step,charts/SPS\n5,100\n10,200\n15,900\n20,1100\n25,1000\n30,\n")
    assert bench.run_scalars(tmp_path) == {"steady_steps_per_s": 1000.0}  # median of 900, 1100, 1000
    (tmp_path / "logs.csv").write_text("step,charts/SPS\n5,100\n10,300\n")
    assert bench.run_scalars(tmp_path) == {"steady_steps_per_s": 200.0}  # two intervals only: all of them
    row = bench.add_fractions({"variant": "", "returncode": 0, "steps": 6000, "wall_s": 10.0, "steps_per_s": 600.0,
                               "steps_per_cpu_s": 300.0, "steady_steps_per_s": 1000.0}, None, None, 1250.0)
    assert row["fraction_of_actors_alone"] == pytest.approx(0.48)
    assert row["steady_fraction_of_actors_alone"] == pytest.approx(0.8)
    assert bench.row_summary(row) == ("6,000 steps in 10.0 s, 600 steps/s (1,000 per interval after the first two), "
                                      "300 steps/CPU-s, 48% of its actors alone (80% after the first two intervals)")
    row.update({"cpu_s": 20.0, "peak_pss_mib": 10.0, "cpu_s_by_depth": [1.0], "monitor_cpu_s": 0.1, "cwd": ".",
                "command": "run.py"})
    text = bench.format_table({"machine": {"cpu": "x", "cores_usable": 16, "torch": "t", "device": "cpu"},
                               "load_average_start": [0.0, 0.0, 0.0], "wall_provisional": False,
                               "components": {"actors": {"actors": 14, "steps_per_s": 1250.0, "steps_per_cpu_s": 1.0,
                                                         "cpu_ms_per_step": 1.0, "what": "14 actors"}},
                               "ceiling": None, "end_to_end": [row]}).splitlines()
    assert ("  48% (80% in its intervals after the first two) of what 14 actors step alone together (1250 steps/s)"
            in text)
    assert "  logged by the run: median agent steps/s per interval after the first two 1,000" in text


def test_an_actor_that_fails_in_the_actors_component_fails_it_with_its_traceback() -> None:
    # Observations of 3 numbers for CartPole's 4: each actor's first forward fails; the others are let go.
    config = bench.Config(env="CartPole-v1", num_actors=2, unroll_length=5)
    shape = bench.EnvShape((3,), torch.float32, 2, "mlp")
    with pytest.raises(RuntimeError, match="an actor of the actors component failed:\n.*Traceback"):
        bench.bench_actors(config, shape, 0.2)


def test_ctrl_c_while_the_actors_component_runs_ends_the_bench_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C reaches the bench and its actor processes (one process group): exit code 130, one line, no
    traceback from any of them, and no process left."""
    with _sigint_as_a_terminal_leaves_it():
        bench_run = subprocess.Popen(
            [sys.executable, "-m", "impala.bench", "--env", "CartPole-v1", "--only", "actors", "--num_actors", "2",
             "--seconds", "60"],
            cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_spawned(bench_run.pid)) < 2:  # both actors, not only one
            assert time.monotonic() < deadline, "the actors did not start within 60 s"
            time.sleep(0.1)
        time.sleep(1.0)  # the actors build their nets and step
        os.killpg(bench_run.pid, signal.SIGINT)
        _, err = bench_run.communicate(timeout=60)
    finally:
        if bench_run.poll() is None:
            os.killpg(bench_run.pid, signal.SIGKILL)
    assert bench_run.returncode == 130, err
    assert err.strip() == "bench: interrupted", err
    assert wait_until_gone(bench_run.pid) == []


def test_sigterm_to_the_bench_alone_stops_its_end_to_end_run_and_leaves_nothing() -> None:
    """`kill PID` (or `timeout`) on the bench while its end-to-end run trains: the run is stopped with it, not left
    training on its own, its temporary savedir is removed, and the bench says so in one line, exit code 143."""
    bench_run = subprocess.Popen(
        [sys.executable, "-m", "impala.bench", "--env", "CartPole-v1", "--unroll_length", "5", "--only", "e2e",
         "--total_steps", "100000000"],
        cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err, argv = sigterm_to_it_alone(  # once run.py has started its actors
        bench_run, lambda: any(len(children(run)) >= 2 for run in runs_started_by(bench_run.pid)))
    assert bench_run.returncode == 143, err
    assert err.strip().splitlines()[-1] == "bench: stopped by SIGTERM", err
    assert "Traceback" not in err
    assert wait_until_gone(bench_run.pid) == []
    savedir = Path(argv[argv.index("--savedir") + 1])
    assert savedir.name.startswith("impala-bench-") and not savedir.exists()


@contextlib.contextmanager
def _sigint_as_a_terminal_leaves_it() -> Iterator[None]:
    """SIGINT raising KeyboardInterrupt in this process, and at its default in the processes it starts inside, as
    in a terminal: a test run started in the background by a shell script (`pytest &`) has it ignored, and a
    Python started with it ignored leaves it so."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _spawned(pid: int) -> list[int]:
    """The children of `pid` that multiprocessing spawned to run a target (not its resource tracker)."""
    spawned = []
    for child in children(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                spawned.append(child)
    return spawned


def test_a_ctrl_c_while_the_actors_start_is_kept_and_interrupts_the_bench_once_they_have_started() -> None:
    """SIGINT is blocked, not ignored, while the actors start: a Ctrl-C that comes meanwhile is kept for this
    process, and the children start, and stay, with it blocked."""
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=signal.sigwait, args=({signal.SIGINT},))  # returns on a SIGINT that is blocked
    kept = interrupted = False
    try:
        try:
            with _sigint_as_a_terminal_leaves_it(), bench.ctrl_c_left_to_this_process():
                child.start()
                # Ctrl-C, while the actors start: to this thread (a Ctrl-C goes to any thread that does not block it)
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                kept = signal.SIGINT in signal.sigpending()
        except KeyboardInterrupt:  # as the block ends
            interrupted = True
        assert kept, "kept"
        assert interrupted, "interrupted"
        os.kill(child.pid, signal.SIGINT)  # the Ctrl-C its process group gets
        child.join(timeout=30)
        assert child.exitcode == 0  # it waited for that SIGINT rather than dying of it
    finally:
        child.kill()
        child.join()


def test_physical_cores_count_the_hyperthreads_of_one_core_once(tmp_path: Path) -> None:
    # Logical CPUs 0 and 2 are the two threads of core 0, 1 and 3 of core 1, on one package.
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_id").write_text(f"{core}\n")
        (topology / "physical_package_id").write_text("0\n")
    assert bench.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert bench.physical_cores({0, 2}, tmp_path) == 1
    assert bench.physical_cores({0, 1}, tmp_path) == 2
    assert bench.physical_cores({0, 7}, tmp_path) is None  # no topology for CPU 7


def test_gpu_busy_is_the_mean_of_nvidia_smis_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nvidia-smi"  # prints three samples, then waits to be stopped as the real one does
    # its arguments written, whole (renamed into place), after the samples: once they are there, so are the samples
    fake.write_text("#!/bin/sh\necho 10\necho 20\necho 45\nd=$(dirname \"$0\")\n"
                    "echo \"$@\" > \"$d/args.tmp\" && mv \"$d/args.tmp\" \"$d/args\"\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with bench.gpu_busy(1) as busy:
        deadline = time.monotonic() + 10
        while not (tmp_path / "args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert busy == {"gpu_busy": pytest.approx(0.25)}  # (10 + 20 + 45) / 3 percent
    assert (tmp_path / "args").read_text().split() == ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                                        "-i", "1", "-lms", str(bench.GPU_POLL_MS)]
    with bench.gpu_busy(None) as busy:  # no GPU: nothing sampled
        pass
    assert busy == {}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with bench.gpu_busy(0) as busy:  # no nvidia-smi
        pass
    assert busy == {}


def test_nvidia_smi_is_asked_for_the_gpu_that_torch_numbers_under_cuda_visible_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi numbers every GPU of the machine; torch's cuda:0 under CUDA_VISIBLE_DEVICES=3 is its GPU 3."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert bench.nvidia_smi_id(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-8f2c")
    assert [bench.nvidia_smi_id(i) for i in range(3)] == ["3", "GPU-8f2c", "2"]


def test_the_learners_warm_up_comes_before_the_gpus_busy_share_is_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph's capture, or --compile's minute of compiling, leaves the GPU idle: sampled with the timed
    window, it made the compiled learner look half as busy as the eager one."""
    calls: list[str] = []

    @contextlib.contextmanager
    def sampled(device_index: int | None) -> Iterator[dict[str, float]]:
        calls.append("sampling")
        yield {}
        calls.append("sampled")

    monkeypatch.setattr(bench, "gpu_busy", sampled)
    monkeypatch.setattr(bench, "warm_up", lambda step, seconds, lockstep=None: calls.append("warm-up"))
    monkeypatch.setattr(bench, "timed_loop", lambda step, seconds, lockstep=None, warm=True: (
        calls.append(f"timed warm={warm}"), step(), bench.Rate(1, 1.0, 1.0))[2])
    config = Config(env="CartPole-v1", unroll_length=5, batch_size=2, hidden_size=16, disable_cuda=True)
    bench.bench_learner(config, bench.env_shape(config), seconds=0.1)
    assert calls == ["warm-up", "sampling", "timed warm=False", "sampled"]


def test_end_to_end_command_passes_the_config_then_extra_flags() -> None:
    _, config, only = bench.parse_args(["--env", "CartPole-v1", "--no-amp", "--only", "e2e"])
    argv = bench.run_argv(config, "/tmp/x", ["--inference", "central"])
    assert only == ["e2e"]
    assert argv[:2] == [sys.executable, "run.py"]
    assert argv[argv.index("--savedir") + 1] == "/tmp/x"
    assert argv[argv.index("--total_steps") + 1] == "60000" and argv[argv.index("--num_actors") + 1] == "2"
    assert "--no-amp" in argv and "--disable_cuda" not in argv
    assert argv[-2:] == ["--inference", "central"] and argv.count("--inference") == 1
    argv = bench.run_argv(config, "/tmp/x", ["--amp", "--num_actors=3"])
    assert "--no-amp" not in argv and "--amp" in argv and argv[-1] == "--num_actors=3"
    assert "--num_actors" not in argv
    assert "--inference_threads" not in argv  # at its default: run.py would say it is unused by actor inference
    _, threads, _ = bench.parse_args(["--env", "CartPole-v1", "--inference_threads", "2"])
    argv = bench.run_argv(threads, "/tmp/x")
    assert argv[argv.index("--inference_threads") + 1] == "2"


def test_num_actors_auto_reaches_the_bench_as_the_trainer_resolves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr("impala.config.cpu_quota", lambda: None)  # whatever this machine's cgroup allows
    _, config, _ = bench.parse_args(["--num_actors", "auto", "--only", "e2e"])
    assert config.num_actors == 14
    argv = bench.run_argv(config, "/tmp/x", [])
    assert argv[argv.index("--num_actors") + 1] == "14"
    _, config, _ = bench.parse_args(["--only", "e2e"])
    assert config.num_actors == 2  # the bench's own default: the README's measured command


def test_unknown_component_is_a_user_error(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--only", "env,gpu"]) == 2
    assert "gpu" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "pattern"), [
    (["--seconds", "0"], r"--seconds must be > 0 and finite, got 0.0"),
    (["--only", " ,"], r"--only ' ,' names no component; choose from env,"),
    (["--seconds", "nan"], r"--seconds must be > 0 and finite, got nan"),
    (["--seconds", "inf"], r"--seconds must be > 0 and finite, got inf"),
    (["--seconds", "abc"], r"argument --seconds: invalid float value: 'abc'"),
    (["--bogus", "1"], r"unrecognized arguments: --bogus 1"),
    (["--json", "/tmp"], r"--json /tmp is a directory; name a file in it"),
    (["--json", "/dev/null/b.json"], r"--json /dev/null/b.json: its directory does not exist"),
    (["--extra", "--xpid 'a"], r"--extra \"--xpid 'a\": No closing quotation"),
    (["--variants", "", "--seed '3"], r"--variants \"--seed '3\": No closing quotation"),
    (["--json", "/nonexistent-dir/b.json"], r"--json /nonexistent-dir/b.json: its directory does not exist"),
    (["--json", ""], r"--json is empty \(an unset shell variable\?\); pass a path, or leave the flag out"),
    (["--json", "~nouser/b.json"], r"--json ~nouser/b.json: ~nouser is the home of a user 'nouser', and there is none"),
    (["--json", "/tmp/" + "/".join(["d" * 200] * 21) + "/b.json"], r"it is 4,\d{3} bytes long, more than a path"),
    # the run a bench's end-to-end row trains is its own: it never continues or writes over a saved one
    (["--extra", "--savedir /tmp/runs --xpid mine"], (r"--extra '--savedir /tmp/runs --xpid mine': the bench trains a "
     r"new run of its own, in a temporary directory: leave out --savedir, --xpid$")),
    (["--variants", "", " --resume", "--extra=--checkpoint=best"], (r"--extra '--checkpoint=best': .*leave out "
     r"--checkpoint$")),
    (["--variants", "", " --resume"], r"--variants ' --resume': .*leave out --resume$"),
    (["--extra", "--mode plot"], r"--extra '--mode plot': .*leave out --mode$"),
    # run.py's own flags, checked as run.py checks them before the first end-to-end run, not in their row later
    (["--extra=--bogus"], r"--extra '--bogus': unrecognized arguments: --bogus"),
    (["--variants", "", "--num_actors x"], r"--variants '--num_actors x': argument --num_actors: takes a number"),
    (["--extra", "--unroll_length 2", "--variants", "", " --batch_size 0"],
     r"--variants ' --batch_size 0': --batch_size must be >= 1, got 0"),
    # the env and model a run probes first
    (["--variants", "", " --env Pendulum-v1"],
     r"--variants ' --env Pendulum-v1': env 'Pendulum-v1' has action space Box\(.*\); only Discrete is supported"),
    (["--extra", "--env CartPole-v1 --model shallow"],
     r"--extra '--env CartPole-v1 --model shallow': --model shallow needs image observations"),
])
def test_bad_bench_flags_are_one_line_before_anything_runs(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, flags: list[str], pattern: str) -> None:
    monkeypatch.setattr(bench, "bench_end_to_end", lambda *args: pytest.fail("a run started"))
    assert bench.main(["--only", "e2e", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: error: ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err


def test_under_torchrun_only_the_learner_is_measured(capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank runs what --only names: two ranks' end-to-end runs would train as one run of two ranks, its
    steps those of both and its CPU time rank 0's alone."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert distributed.launched_by_torchrun()
    monkeypatch.setattr(bench, "run_bench", lambda *args: pytest.fail("a component ran"))
    assert bench.main(["--only", "learner,e2e", "--env", "CartPole-v1"]) == 2
    assert capsys.readouterr().err == ("bench: error: --only 'learner,e2e' under torchrun: only the learner is "
                                       "measured on several ranks (--only learner); run the other components "
                                       "without torchrun\n")
    assert bench.parse_args(["--only", "learner", "--env", "CartPole-v1"])[2] == ["learner"]


def test_the_ceilings_count_the_cores_a_cgroup_quota_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker run --cpus 4` on a bigger host: 4 cores' worth of CPU time, as --num_actors auto counts them."""
    monkeypatch.setattr(bench, "usable_cores", lambda: 4)
    monkeypatch.setattr(bench, "env_shape", lambda config: bench.EnvShape((4,), torch.float32, 2, "mlp"))
    for name, rate in (("env", 1000.0), ("inference", 500.0), ("learner", 250.0)):
        monkeypatch.setattr(bench, f"bench_{name}", lambda *args, rate=rate: {
            "steps_per_s": rate, "steps_per_cpu_s": rate, "device": "cpu"})
    args, config, only = bench.parse_args(["--only", "env,inference,learner", "--env", "CartPole-v1"])
    results = bench.run_bench(args, config, only)
    assert results["ceiling"]["cores"] == 4
    assert results["ceiling"]["steps_per_s"] == pytest.approx(4 / (1 / 1000 + 1 / 500 + 1 / 250))
    assert results["env_ceiling_steps_per_s"] == pytest.approx(4000.0)


def test_a_model_the_env_cannot_take_is_one_line_before_a_component_runs(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--only", "env", "--env", "CartPole-v1", "--model", "shallow"]) == 2
    err = capsys.readouterr().err
    assert err == "bench: error: --model shallow needs image observations [C, H, W], got shape (4,)\n", err


def test_compile_without_a_compiler_is_one_line_before_the_learner_runs(capsys: pytest.CaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    from torch._inductor import config as inductor_config
    monkeypatch.setattr(bench, "run_bench", lambda *args: pytest.fail("a component ran"))
    with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-g++"),)}):  # run.py's refusal, in the bench
        assert bench.main(["--only", "learner", "--compile", "--disable_cuda", "--env", "CartPole-v1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: error: --compile needs a C++ compiler, ") and err.count("\n") == 1, err


def test_process_tree_cpu_counts_a_grandchild(tmp_path: Path) -> None:
    """A child that only waits for a busy grandchild: the tree's CPU is the grandchild's."""
    busy = "import time\nwhile time.process_time() < 1.0:\n    pass\n"
    child = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {busy!r}], check=True)
    """)
    usage = bench.measure_process_tree([sys.executable, "-c", child], log_path=tmp_path / "out.log")
    assert usage.returncode == 0, (tmp_path / "out.log").read_text()
    assert usage.processes >= 2
    assert usage.cpu_s >= 0.5
    assert usage.cpu_s_by_depth[1] >= 0.5  # the grandchild of this test is the root's child
    assert usage.cpu_s_wait4 >= 0.9  # the child reaped the grandchild: its rusage includes it
    assert usage.peak_pss_bytes > 0


def test_process_tree_reports_the_exit_code() -> None:
    usage = bench.measure_process_tree([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert usage.returncode == 3


def test_variants_give_one_end_to_end_row_each(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Each row is also printed in a line as it ends, so that a bench stopped in a later row keeps it."""
    calls = []

    def fake_end_to_end(config: object, extra: list[str], variant: str) -> dict:
        calls.append(extra)
        return {"variant": variant, "returncode": 3 if "--no-amp" in extra else 0, "steps": 12000,
                "wall_s": 2.5, "steps_per_s": 4800.0, "steps_per_cpu_s": 1234.4}

    monkeypatch.setattr(bench, "bench_end_to_end", fake_end_to_end)
    args, config, only = bench.parse_args(["--env", "CartPole-v1", "--only", "e2e", "--extra", "--seed 3",
                                           "--variants", "", "--inference central --inference_wait_ms 2",
                                           " --no-amp"])
    results = bench.run_bench(args, config, only)
    assert calls == [["--seed", "3"], ["--seed", "3", "--inference", "central", "--inference_wait_ms", "2"],
                     ["--seed", "3", "--no-amp"]]
    assert [row["variant"] for row in results["end_to_end"]] == ["", "--inference central --inference_wait_ms 2",
                                                                 "--no-amp"]
    assert results["ceiling"] is None and results["components"] == {}
    done = [line for line in capsys.readouterr().err.splitlines() if line.endswith(("steps/CPU-s", "with 3"))]
    assert done == ["bench: end to end (base flags): 12,000 steps in 2.5 s, 4,800 steps/s, 1,234 steps/CPU-s",
                    ("bench: end to end --inference central --inference_wait_ms 2: 12,000 steps in 2.5 s, "
                     "4,800 steps/s, 1,234 steps/CPU-s"),
                    ("bench: end to end --no-amp: 12,000 steps in 2.5 s, 4,800 steps/s, 1,234 steps/CPU-s; "
                     "exited with 3")]


def test_a_row_carries_what_the_run_logged(tmp_path: Path) -> None:
    """The means over the run's rows of the policy lag, the learner's times and the actors' shares; Ray's
    running totals from the last row that has them."""
    (tmp_path / "logs.csv").write_text(textwrap.dedent("""\
        step,stats/policy_lag,ray/bytes_per_step,ray/receive_ms_per_unroll,timing/forward_backward_ms,actors/env_share
        100,1.0,29000.5,0.25,10.0,0.5
        200,3.0,29100.0,,20.0,0.25
        300,,,,,
    """))
    assert bench.run_scalars(tmp_path) == {"mean_policy_lag": 2.0, "ray_bytes_per_step": 29100.0,
                                           "ray_receive_ms_per_unroll": 0.25, "forward_backward_ms": 15.0,
                                           "actor_env_share": 0.375}
    assert bench.run_scalars(tmp_path / "missing") == {}
    row = {"variant": "--ray local", "returncode": 0, "steps": 300, "wall_s": 1.0, "steps_per_s": 300.0,
           "cpu_s": 2.0, "steps_per_cpu_s": 150.0, "peak_pss_mib": 10.0, "cpu_s_by_depth": [1.0],
           "monitor_cpu_s": 0.1, "cwd": ".", "command": "run.py", **bench.run_scalars(tmp_path)}
    text = bench.format_table({"machine": {"cpu": "x", "cores_usable": 2, "torch": "t", "device": "cpu"},
                               "load_average_start": [0.0, 0.0, 0.0], "wall_provisional": False,
                               "components": {}, "ceiling": None, "end_to_end": [row]})
    assert ("  logged by the run: mean policy lag 2.00, learner ms per batch updating 15.0, actors' time stepping "
            "envs 38%, Ray bytes per agent step 29,100, receiver ms per unroll 0.250") in text.splitlines()


def test_a_row_says_what_its_run_could_not_do_and_did_otherwise() -> None:
    """A GPU row measured after a capture fell back to eager launches must not pass for the graphed one."""
    log = ("[01:00:00] Run x: Pong\n"
           "[01:00:05] Could not capture the update as a CUDA graph (boom); updating without one\n"
           "[01:00:06] Could not page-lock the slots' observations for the GPU (no, 30 MiB); the learner stacks\n"
           "[01:00:09] Could not capture the update as a CUDA graph (boom); updating without one\n")
    said = bench.fallbacks(log)
    assert said == ["Could not capture the update as a CUDA graph (boom); updating without one",
                    "Could not page-lock the slots' observations for the GPU (no, 30 MiB); the learner stacks"]
    assert bench.fallbacks("[01:00:00] Run x: Pong\n") == []
    row = {"variant": "", "returncode": 0, "steps": 300, "wall_s": 1.0, "steps_per_s": 300.0, "cpu_s": 2.0,
           "steps_per_cpu_s": 150.0, "peak_pss_mib": 10.0, "cpu_s_by_depth": [1.0], "monitor_cpu_s": 0.1, "cwd": ".",
           "command": "run.py", "fallbacks": said}
    text = bench.format_table({"machine": {"cpu": "x", "cores_usable": 2, "torch": "t", "device": "cuda"},
                               "load_average_start": [0.0, 0.0, 0.0], "wall_provisional": False,
                               "components": {}, "ceiling": None, "end_to_end": [row]})
    assert "  the run fell back: Could not capture the update as a CUDA graph (boom); updating without one\n" in text


def test_bench_json_never_replaces_a_file_that_is_not_json(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """`--json RUN/model.tar`, a slip of the shell's completion: refused, the checkpoint as it was; a .json file of
    an earlier bench is replaced, as asked."""
    checkpoint = tmp_path / "model.tar"
    checkpoint.write_bytes(b"weights")
    assert bench.main(["--env", "CartPole-v1", "--only", "env", "--seconds", "0.2", "--json", str(checkpoint)]) == 2
    assert capsys.readouterr().err == (f"bench: error: --json {checkpoint}: a file of that name is there, and the "
                                       "results would replace it; name a new file, or one ending in .json\n")
    assert checkpoint.read_bytes() == b"weights"
    earlier = tmp_path / "bench.json"
    earlier.write_text("{}")
    assert bench.main(["--env", "CartPole-v1", "--only", "env", "--seconds", "0.2", "--json", str(earlier)]) == 0
    assert json.loads(earlier.read_text())["components"]["env"]["steps_per_s"] > 0
