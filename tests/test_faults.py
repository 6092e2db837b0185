"""Faults of a run: non-finite updates never reach the weights; a killed actor is replaced and training goes
on; actors that keep dying stop the run with the reason; a killed main process leaves no actor behind and
its run resumes."""

from __future__ import annotations

import csv
import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import crashing_env
import pytest
import torch
from process_helpers import (
    REPO_ROOT,
    SMALL_RUN,
    Training,
    checkpoint_step,
    children,
    group_processes,
    run_py,
    train_through_one_crash,
    wait_until_gone,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from impala import actor_pool, learner, training
from impala.actor_pool import LocalActorPool
from impala.config import Config, UserError
from impala.learners import Learners
from impala.metrics import IntervalStats
from impala.model import Net
from impala.rundir import DirectoryLock
from impala.stopping import StopRequests

T, B = 5, 4


def _batch(reward: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"obs": torch.randn(T + 1, B, 4, generator=generator), "done": torch.zeros(T + 1, B, dtype=torch.bool),
            "reward": torch.full((T + 1, B), reward), "truncated": torch.zeros(T + 1, B, dtype=torch.bool),
            "truncation_value": torch.zeros(T + 1, B), "action": torch.randint(0, 2, (T + 1, B), generator=generator),
            "policy_logits": torch.zeros(T + 1, B, 2)}


def test_a_non_finite_update_is_skipped_and_leaves_the_weights_alone() -> None:
    config = Config(env="CartPole-v1", unroll_length=T, batch_size=B, total_steps=10_000, reward_clipping="none")
    torch.manual_seed(0)
    model = Net((4,), 2, "mlp", False, 32)
    optimizer, scheduler = learner.make_optimizer(model, config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = learner.update(model, optimizer, scheduler, _batch(float("nan")), (), config)
    assert stats["skipped"] == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for state in optimizer.state.values():  # fused Adam makes its state, then skips: nothing counted or accumulated
        assert float(state["step"]) == 0 and all(not v.any() for k, v in state.items() if k != "step"), state
    stats = learner.update(model, optimizer, scheduler, _batch(1.0), (), config)
    assert stats["skipped"] == 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_run_of_non_finite_updates_stops_learning_with_a_clear_error() -> None:
    config = Config(max_bad_updates=3)
    run = types.SimpleNamespace(config=config, errors=[], stop_event=threading.Event(),
                                state=types.SimpleNamespace(skipped_updates=0, bad_updates_in_a_row=0, step=100),
                                stats=IntervalStats(), failed_at=None)
    run._fail = functools.partial(Learners._fail, run)
    bad = {"skipped": 1.0, "total_loss": float("nan"), "grad_norm": float("nan")}
    good = {"skipped": 0.0, "total_loss": 0.5, "grad_norm": 0.25}
    for stats in (bad, bad, good, bad, bad):  # a good update between: not 3 in a row yet
        Learners.record(run, stats, 0.0)
    assert run.state.skipped_updates == 4 and run.state.bad_updates_in_a_row == 2 and not run.stop_event.is_set()
    assert run.errors == []
    Learners.record(run, bad, 0.0)
    assert run.stop_event.is_set()
    assert isinstance(run.errors[0], training.TrainingError)
    assert "3 non-finite updates in a row" in str(run.errors[0])
    assert "last good checkpoint" in str(run.errors[0])


@pytest.mark.parametrize("failed_first", [True, False], ids=["fault then signal", "signal then fault"])
def test_a_learners_fault_before_a_stop_signal_is_why_the_run_ends(failed_first: bool) -> None:
    """torchrun sends SIGTERM to the ranks left once one died, after their learners found it gone: the run ends as
    the fault (exit code 1, meta.json's "error"), not as a stop. A signal that came first stays the reason."""
    stop = StopRequests()
    learners = types.SimpleNamespace(errors=[], failed_at=None, stop_event=threading.Event())
    fault = training.TrainingError("another learner process stopped answering")
    events = [lambda: Learners._fail(learners, fault), lambda: stop.record(signal.SIGTERM, None)]
    for event in events if failed_first else events[::-1]:
        event()
        time.sleep(0.002)  # apart on the monotonic clock
    learners.failed_before = functools.partial(Learners.failed_before, learners)
    run = types.SimpleNamespace(config=None, state=types.SimpleNamespace(step=0), started_s=None, stop=stop,
                                learners=learners, inference=None)
    if failed_first:
        with pytest.raises(training.TrainingError, match="another learner process stopped answering"):
            training.monitor(run)
    else:
        assert training.monitor(run) == "terminated"


def _trains_on_then_stops_in_order(run: Training, from_step: int) -> None:
    """The run trains 2,000 agent steps past `from_step`, then stops in order on SIGTERM, leaving no process."""
    run.wait_for_steps(from_step + 2_000)
    run.signal(signal.SIGTERM)
    assert run.wait(timeout=30) == 143
    assert wait_until_gone(run.pgid, timeout=30) == []


def test_a_killed_actor_is_replaced_and_training_goes_on(tmp_path: Path) -> None:
    run = Training(tmp_path, "kill-actor")  # far more steps than the test waits for
    try:
        run.wait_for_steps(500)
        victim = run.actor_pids()[0]
        # The out-of-memory killer's first choice, before the main process: an actor is replaced.
        assert Path(f"/proc/{victim}/oom_score_adj").read_text() == "500\n"
        os.kill(victim, signal.SIGKILL)
        run.wait_for(rf"Actor 0 \(pid {victim}\) died: killed by SIGKILL", timeout=15)
        restarted = run.wait_for(r"Restarted actor 0 \(\d+ slots returned", timeout=15)
        assert run.actor_pids()[0] != victim
        step_at_restart = run.latest_step()
        _trains_on_then_stops_in_order(run, step_at_restart)
        assert run.latest_step(after=restarted.end()) > step_at_restart
    finally:
        run.close()
    assert checkpoint_step(run.run_dir) >= step_at_restart + 2_000


def test_a_run_directory_deleted_while_the_run_goes_on_is_made_again_with_a_checkpoint(tmp_path: Path) -> None:
    run = Training(tmp_path, "gone")  # far more steps than the test waits for
    try:
        run.wait_for_steps(500)
        while run.run_dir.exists():  # a file the run writes meanwhile can make one rmtree miss the directory
            shutil.rmtree(run.run_dir, ignore_errors=True)
        went = run.wait_for(r"The run directory .*gone went while the run went on \(deleted, or moved away\); made "
                            r"again, with the run's flags, a checkpoint now and its logs from step (\d+) on", timeout=15)
        saved = run.wait_for(r"Saved checkpoint at step (\d+)", after=went.end(), timeout=15)
        with pytest.raises(UserError, match="in use by another training"), DirectoryLock() as lock:
            lock.hold(run.run_dir)  # the run holds the new directory as it held the old
        (run.run_dir / "model.tar").unlink()  # and model.tar alone: saved again at once
        lost = run.wait_for(r"model.tar went while the run went on \(deleted, or moved away\): saving a checkpoint "
                            "now", after=saved.end(), timeout=15)
        saved = run.wait_for(r"Saved checkpoint at step (\d+)", after=lost.end(), timeout=15)
        assert (run.run_dir / "model.tar").is_file()
        _trains_on_then_stops_in_order(run, int(saved[1]))
    finally:
        run.close()
    assert checkpoint_step(run.run_dir) >= int(saved[1]) + 2_000
    assert json.loads((run.run_dir / "flags.json").read_text())["env"] == "CartPole-v1"
    meta = json.loads((run.run_dir / "meta.json").read_text())
    assert meta["end_reason"] == "terminated" and meta["remade"] and meta["checkpoint_step"] >= int(saved[1]) + 2_000
    assert "The run directory" in (run.run_dir / "out.log").read_text()  # out.log begun again in it
    with open(run.run_dir / "logs.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps and steps[0] >= int(went[1])
    assert list(run.run_dir.glob("events.out.tfevents.*"))


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here: the pool believes is_alive")
def test_a_killed_fork_server_costs_every_actor_its_life_and_no_old_life_goes_on_writing(tmp_path: Path) -> None:
    """The fork server carries its actors' exit codes: killed (by hand, or out of memory), every actor reads as
    ended, exit code 255, while it still runs. Each must be killed before its slots go to its next life, or two
    processes write the same slots for the rest of the run; all of them are one restart, not one each. The
    evaluator, also the fork server's child, is killed before its replacement starts."""
    run = Training(tmp_path, "fork-server", "--max_actor_restarts", "1",  # two actors
                   "--eval_interval_s", "0.2", "--eval_episodes", "1")
    try:
        run.wait_for_steps(500)
        old = run.actor_pids()
        evaluator = int(run.wait_for(r"Evaluator started \(pid (\d+)\)").group(1))
        deadline = time.monotonic() + 15  # set by the evaluator's own start, which may still be under way
        while Path(f"/proc/{evaluator}/oom_score_adj").read_text() != "500\n" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"/proc/{evaluator}/oom_score_adj").read_text() == "500\n"  # chosen before the main process
        servers = [pid for pid in children(run.process.pid)
                   if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(servers) == 1 and {*old.values(), evaluator} <= set(children(servers[0])), (servers, old)
        os.kill(servers[0], signal.SIGKILL)
        run.wait_for(rf"The evaluator \(pid {evaluator}\) still runs though the fork server reported its end "
                     r"\(exit code 255\): the fork server has died; killing it before its replacement starts",
                     timeout=15)
        run.wait_for(r"Restarted the evaluator", timeout=15)
        assert evaluator not in group_processes(run.pgid), "the old evaluator outlived its replacement's start"
        for index, pid in old.items():
            run.wait_for(rf"Actor {index} \(pid {pid}\) still runs though the fork server reported its end \(exit "
                         r"code 255\): the fork server has died; killing the actor", timeout=15)
            run.wait_for(rf"Restarted actor {index} \(\d+ slots returned; 1 restarts within 600 s", timeout=15)
        assert not set(old.values()) & set(group_processes(run.pgid)), "an old life outlived its replacement's start"
        assert set(run.actor_pids().values()).isdisjoint(old.values())
        step_at_restart = run.latest_step()
        _trains_on_then_stops_in_order(run, step_at_restart)  # the new lives, from a new fork server
    finally:
        run.close()
    assert checkpoint_step(run.run_dir) >= step_at_restart + 2_000


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_killed_actor_under_central_inference_is_replaced_and_the_run_ends_at_its_total(
        tmp_path: Path, threads: str) -> None:
    total_steps = 6_000
    # While it waits for a fuller batch the inference thread keeps waiting on the dead actor's pipe, which
    # reads as ready (end of file): the monitor replaces that pipe in the middle of the wait. With two threads
    # actor 0 is the only client of the first: it serves nobody until the replacement connects.
    run = Training(tmp_path, "kill-central", "--inference", "central", "--inference_wait_ms", "20",
                   "--inference_threads", threads, total_steps=total_steps)
    try:
        run.wait_for_steps(500)
        victim = run.actor_pids()[0]
        os.kill(victim, signal.SIGKILL)
        run.wait_for(rf"Actor 0 \(pid {victim}\) died: killed by SIGKILL", timeout=15)
        run.wait_for(r"Restarted actor 0 \(\d+ slots returned", timeout=15)
        assert run.wait(timeout=180) == 0
        assert wait_until_gone(run.pgid, timeout=30) == []
    finally:
        run.close()
    assert "inference thread failed" not in run.text()
    assert checkpoint_step(run.run_dir) == total_steps


# Runs run.py with InferenceServer._act raising on its 200th call: a fault in the inference thread's forward.
_FAILING_INFERENCE = """
import sys
import run
from impala.inference import InferenceServer
act, calls = InferenceServer._act, []
def failing_act(self, clients):
    calls.append(clients)
    if len(calls) == 200:
        raise RuntimeError("injected fault")
    return act(self, clients)
InferenceServer._act = failing_act
sys.exit(run.main(sys.argv[1:]))
"""


def test_a_failed_inference_thread_stops_the_run_with_one_line_and_keeps_a_checkpoint(tmp_path: Path) -> None:
    args = [*SMALL_RUN, "--inference", "central", "--total_steps", "10000000", "--savedir", str(tmp_path),
            "--xpid", "dead-inference"]
    process = subprocess.Popen([sys.executable, "-c", _FAILING_INFERENCE, *args], cwd=REPO_ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=120)  # a hang (the fault unnoticed) fails here
    finally:
        for pid in group_processes(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 1, stdout[-3000:] + stderr
    assert stderr == "run.py: training failed: the central inference thread failed: RuntimeError: injected fault\n"
    out_log = (tmp_path / "dead-inference" / "out.log").read_text()
    assert "Traceback (most recent call last)" in out_log and "RuntimeError: injected fault" in out_log
    assert checkpoint_step(tmp_path / "dead-inference") > 0  # what was learned before the fault is saved


class _Exiting:
    """An actor process as `LocalActorPool.check` sees it: alive or not."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_learner_thread_ended_by_a_librarys_sys_exit_stops_the_run_saying_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """SystemExit is no Exception: a learner thread it ended went without a word, the monitor saw no error, and the
    run stalled for good (actors waiting for slots count as alive)."""
    learners = object.__new__(Learners)
    learners.errors, learners.failed_at, learners.busy_since = [], None, {}
    learners.stop_event = threading.Event()

    def exits() -> None:
        sys.exit(3)

    learners._learn = exits
    learners._thread()
    assert [type(error) for error in learners.errors] == [SystemExit] and learners.stop_event.is_set()
    assert "Learner thread MainThread failed" in caplog.text
    run_ = types.SimpleNamespace(learners=learners, inference=None)
    with pytest.raises(training.TrainingError, match=r"^learner thread failed: SystemExit\(3\)$"):
        training._check_threads(run_)


def test_actors_started_before_one_that_failed_to_start_are_the_pools_to_stop() -> None:
    """A start that fails part way (fork's ENOMEM at actor 2): the actors already running are in `processes`, which
    `stop` waits for and kills, rather than left to end by themselves."""
    pool = object.__new__(LocalActorPool)
    pool.config = Config(env="CartPole-v1", num_actors=4)
    started: list[_Exiting] = []

    def start_actor(index: int) -> _Exiting:
        if index == 2:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        started.append(_Exiting(alive=True))
        return started[-1]

    pool.start_actor = start_actor
    with pytest.raises(OSError, match="Cannot allocate memory"):
        pool.start()
    assert pool.processes == started and len(started) == 2


def test_the_traceback_of_an_actor_still_exiting_is_reported_with_its_death_at_the_next_check() -> None:
    """Two actors fail together: one has exited, the other has sent its traceback and is still exiting. The
    first check reads both tracebacks; the second actor's is kept for the check that finds it dead."""
    pool = object.__new__(LocalActorPool)
    first, second = _Exiting(alive=False), _Exiting(alive=True)
    sent = [{0: "Traceback: first", 1: "Traceback: second"}, {}]
    replaced: list[tuple[int, str]] = []
    pool.processes = [first, second]
    pool._unclaimed, pool._pidfds, pool.oom_kills = {}, {}, actor_pool.OomKills()
    pool.kill_hung = lambda: None
    pool.tracebacks = lambda: sent.pop(0)
    pool._replace = lambda index, process, detail, counted: replaced.append((index, detail))
    pool.check()
    assert replaced == [(0, "Traceback: first")]
    pool.processes = [_Exiting(alive=True), second]  # the first one's replacement runs; the second has exited
    second.alive = False
    pool.check()
    assert replaced == [(0, "Traceback: first"), (1, "Traceback: second")]


def test_deaths_count_within_the_window_or_in_a_row_without_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few actors whose env hangs in every life die once per --actor_timeout_s each: too seldom for the 10-minute
    window, and the run would retry for ever without learning again. Deaths in a row with no progress between
    them count too; progress starts the row again."""
    now = [1000.0]
    monkeypatch.setattr(actor_pool.time, "monotonic", lambda: now[0])
    deaths = actor_pool.RecentDeaths()
    counts = []
    for _ in range(12):  # 4 actors, each killed every 300 s: 2 deaths a window, 8 a row
        counts.append(deaths.add(progress=7))
        now[0] += 75
    assert counts == list(range(1, 13)) and deaths.span() == "in a row, with no progress in between"
    assert deaths.add(progress=8) == 8 and deaths.span() == "within 600 s"  # an update learned: a new row
    now[0] += 601
    assert deaths.recent() == 1 and deaths.add(progress=8) == 2


def test_a_sigkill_soon_after_the_oom_killer_struck_is_told_as_most_likely_for_want_of_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a container's memory limit the kernel's OOM killer ends actors with SIGKILL, as a person's `kill -9`
    would: the kernel's count tells them apart (measured: Pong's 4 actors under a 700 MiB cgroup limit died 11
    times, each reported as "killed by SIGKILL" alone). A kill counted by one check stays a likely cause for
    OOM_WINDOW_S, since the actor it ended may be seen dead by a later check; a hung actor the pool killed itself
    is not one."""
    from impala.buffers import UsableMemory

    now = [1000.0]
    monkeypatch.setattr(actor_pool.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(actor_pool, "usable_memory", lambda: UsableMemory(2**30, None))
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 100\noom_kill 5\nnr_zone_active_anon 7\n")
    kills = actor_pool.OomKills((vmstat, "on this machine"))
    assert actor_pool.exit_description(-9, kills, pid=11) == "killed by SIGKILL"
    vmstat.write_text("nr_free_pages 100\noom_kill 7\n")
    now[0] += 1
    kills.look()  # a check finds the kills before it finds their actors dead
    now[0] += 10
    assert actor_pool.exit_description(-9, kills, pid=11) == (
        "killed by SIGKILL, most likely for want of memory (the kernel's OOM killer ended 2 processes on this machine "
        "in the last 30 s, and this machine has 1.0 GiB)")
    kills.killed_here(12)  # hung: the pool's own SIGKILL
    assert actor_pool.exit_description(-9, kills, pid=12) == "killed by SIGKILL"
    kills.killed_here(16)  # hung, but it exited as it was killed: its pid is forgotten all the same
    assert actor_pool.exit_description(1, kills, pid=16) == "exit code 1"
    assert "most likely" in actor_pool.exit_description(-9, kills, pid=16)  # the pid of a later process
    assert actor_pool.exit_description(-15, kills, pid=13) == "killed by SIGTERM"  # not the OOM killer's signal
    assert actor_pool.exit_description(1, kills, pid=13) == "exit code 1"
    now[0] += actor_pool.OOM_WINDOW_S
    assert actor_pool.exit_description(-9, kills, pid=14) == "killed by SIGKILL"  # an old kill: someone else's
    vmstat.write_text("oom_kill 8\n")
    assert "ended 1 process on this machine" in actor_pool.exit_description(-9, kills, pid=15)
    vmstat.unlink()  # a kernel before 4.13, or no /proc: no guess
    now[0] += actor_pool.OOM_WINDOW_S + 1
    assert kills.recent() == 0 and actor_pool.OomKills((vmstat, "on this machine")).recent() == 0


def test_the_oom_kills_counted_are_those_of_the_process_own_cgroup_where_it_can_be_found(tmp_path: Path) -> None:
    """A machine's count is every container's: a `kill -9` beside another job's OOM kill would read as this run's."""
    from impala.config import own_cgroup_file

    proc, root = tmp_path / "cgroup", tmp_path / "sys"

    def own_count(cgroup: str) -> tuple[Path | None, int | None]:
        """The count file found for a process whose /proc/self/cgroup reads `cgroup`, and the count in it."""
        proc.write_text(cgroup)
        found = own_cgroup_file("memory.events", "memory", "memory.oom_control", proc, root)
        return found, None if found is None else actor_pool.OomKills((found, "in this process's cgroup"))._count()

    (root / "memory/jobs/7").mkdir(parents=True)
    (root / "memory/jobs/7/memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert own_count("4:memory:/jobs/7\n0::/\n") == (root / "memory/jobs/7/memory.oom_control", 3)  # cgroup v1
    # No cgroup namespace: the host's path, the container's own cgroup mounted; there, its count.
    assert own_count("4:memory:/docker/abc\n0::/\n") == (None, None)
    (root / "memory/memory.oom_control").write_text("oom_kill 4\n")
    assert own_count("4:memory:/docker/abc\n0::/\n") == (root / "memory/memory.oom_control", 4)
    (root / "kubepods/pod1/c").mkdir(parents=True)
    (root / "kubepods/pod1/c/memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    assert own_count("0::/kubepods/pod1/c\n") == (root / "kubepods/pod1/c/memory.events", 2)  # cgroup v2
    assert own_cgroup_file("memory.events", "memory", "memory.oom_control", tmp_path / "missing", root) is None


def test_actors_lost_with_one_fork_server_count_one_restart_whichever_check_sees_them() -> None:
    """A fork server's death reads as every actor's, but a check may run while only some of them read so: those
    the next check finds are not counted again (with --max_actor_restarts 1 that would end the run)."""
    pool = object.__new__(LocalActorPool)
    pool.processes = [_Exiting(alive=False), _Exiting(alive=True), _Exiting(alive=True)]
    pool._unclaimed, pool._pidfds, pool._lost_servers, pool.oom_kills = {}, {}, set(), actor_pool.OomKills()
    pool._servers = {0: 100, 1: 100, 2: 200}  # actor 2 was started by a later server
    pool.kill_hung, pool.tracebacks = lambda: None, dict
    pool._end_if_lost = lambda index, process: True
    counted: list[tuple[int, bool]] = []
    pool._replace = lambda index, process, detail, count: counted.append((index, count))
    pool.check()
    pool.processes = [_Exiting(alive=True), _Exiting(alive=False), _Exiting(alive=False)]
    pool.check()
    assert counted == [(0, True), (1, False), (2, True)]


def test_a_traceback_read_before_too_many_deaths_stopped_the_run_is_still_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    """The check that found one death too many had already read the traceback of another actor, still exiting:
    stopping the pool reports it, as it reports those that come while it stops."""
    pool = object.__new__(LocalActorPool)
    pool.channels = types.SimpleNamespace(stop_event=threading.Event())
    pool.processes, pool._pidfds, pool._unclaimed = [], {}, {1: "Traceback: second\n"}
    pool.tracebacks = dict
    with caplog.at_level("ERROR"):
        pool.stop(drain=lambda: None)
    assert [r.getMessage() for r in caplog.records] == ["Actor 1 failed:\nTraceback: second"]
    assert pool._unclaimed == {}


def test_a_hung_actor_is_killed_and_replaced(tmp_path: Path) -> None:
    run = Training(tmp_path, "hung-actor", "--actor_timeout_s", "3")
    try:
        run.wait_for_steps(500)
        victim = run.actor_pids()[1]
        os.kill(victim, signal.SIGSTOP)  # alive, but making no progress: an env stuck in a step
        run.wait_for(rf"Actor 1 \(pid {victim}\) made no progress for (?:[3-9]|\d{2,}) s \(--actor_timeout_s 3\); killing it",
                     timeout=20)
        run.wait_for(rf"Actor 1 \(pid {victim}\) died: killed by SIGKILL", timeout=15)
        restarted = run.wait_for(r"Restarted actor 1 \(\d+ slots returned", timeout=15)
        step_at_restart = run.latest_step()
        run.wait_for_steps(step_at_restart + 1_000)
        assert run.latest_step(after=restarted.end()) > step_at_restart
        assert "Actor 0 (pid" not in run.text().split("Actor 1 started")[1]  # the working actor was left alone
        run.signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 143
        assert wait_until_gone(run.pgid, timeout=30) == []
    finally:
        run.close()


def test_an_actor_whose_env_raises_is_reported_once_with_its_traceback_and_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor's traceback reaches the console once, with its death, not also from the dying process itself."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))  # for the env's module, in every process of the run
    result = train_through_one_crash(tmp_path, "--total_steps", "3000")
    assert re.search(r"Actor 0 \(pid \d+\) died: exit code 1", result.stdout)
    assert "Restarted actor 0" in result.stdout
    assert (tmp_path / "crash" / "out.log").read_text().count(crashing_env.MESSAGE) == 1
    assert json.loads((tmp_path / "crash" / "meta.json").read_text())["end_reason"] == "finished"


def test_actors_that_keep_dying_stop_the_run(tmp_path: Path) -> None:
    run = Training(tmp_path, "crash-loop", "--max_actor_restarts", "1")
    try:
        run.wait_for_steps(200)
        first = run.actor_pids()[1]
        os.kill(first, signal.SIGKILL)
        run.wait_for(r"Restarted actor 1", timeout=15)
        os.kill(run.actor_pids()[1], signal.SIGKILL)  # the replacement: a second death within the window
        assert run.wait(timeout=30) == 1
        assert "actors died 2 times within 600 s (--max_actor_restarts 1)" in run.text()
        assert wait_until_gone(run.pgid, timeout=30) == []
    finally:
        run.close()
    assert checkpoint_step(run.run_dir) >= 200  # what was learned is saved


def test_a_killed_main_process_leaves_no_actor_and_its_run_resumes(tmp_path: Path) -> None:
    # Far more steps than the run can reach before the kill, so the checkpoint is a periodic one.
    run = Training(tmp_path, "kill-main", "--checkpoint_interval_s", "0.5", total_steps=10_000_000)
    try:
        run.wait_for(r"Saved checkpoint at step [1-9]")
        os.kill(run.process.pid, signal.SIGKILL)  # no shutdown at all: actors must notice by themselves
        assert run.wait(timeout=10) == -signal.SIGKILL
        assert wait_until_gone(run.pgid, timeout=30) == []
    finally:
        run.close()
    saved = checkpoint_step(run.run_dir)
    assert 0 < saved < 10_000_000
    resumed = Training(tmp_path, "kill-main", total_steps=saved + 2_000)
    try:
        resumed.wait_for(rf"Resuming from step {saved}")
        assert resumed.wait(timeout=120) == 0
    finally:
        resumed.close()
    assert checkpoint_step(run.run_dir) >= saved + 2_000
    with open(run.run_dir / "logs.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert steps == sorted(steps), "one curve: no rows of the killed session after its last checkpoint"


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _small_run(tmp_path: Path, xpid: str, **overrides: object) -> Config:
    flags = {"env": "CartPole-v1", "num_actors": 1, "envs_per_actor": 2, "unroll_length": 5, "batch_size": 4,
             "num_learner_threads": 1, "hidden_size": 16, "total_steps": 3_000, "log_interval_s": 0.2,
             "disable_cuda": True, "savedir": str(tmp_path), "xpid": xpid}
    return Config(**{**flags, **overrides})


def test_failed_periodic_checkpoints_are_reported_and_training_goes_on(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls, failed = [], []
    real_save = training.save_checkpoint
    total_steps = 6_000

    def full_then_free(path: Path, state: dict) -> None:
        calls.append(state["step"])
        if len(failed) < 2 and state["step"] < total_steps:  # the first two periodic saves, however fast the run
            failed.append(state["step"])
            _disk_full()
        real_save(path, state)

    monkeypatch.setattr(training, "save_checkpoint", full_then_free)
    run_dir = training.train(_small_run(tmp_path, "disk-full", checkpoint_interval_s=0.2, total_steps=total_steps))
    assert len(failed) == 2, f"the run ended before two periodic saves: {calls}"
    log_text = (run_dir / "out.log").read_text()
    assert log_text.count("Could not save a checkpoint at step") == 2
    assert "No space left on device. Training goes on (no checkpoint saved yet)" in log_text
    assert len(calls) >= 3 and log_text.count("Saved checkpoint at step") >= 2  # a periodic one, and the final
    assert checkpoint_step(run_dir) == total_steps
    assert '"end_reason": "finished"' in (run_dir / "meta.json").read_text()


def test_a_failed_final_checkpoint_fails_the_run_with_one_clear_reason(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "save_checkpoint", _disk_full)
    with pytest.raises(training.TrainingError, match=r"could not save the final checkpoint to .*model\.tar: "
                                                     r".*No space left on device \(no checkpoint saved yet\)"):
        training.train(_small_run(tmp_path, "final-full"))
    assert not (tmp_path / "final-full" / "model.tar").exists()


def test_a_failed_log_write_is_reported_once_and_tensorboard_still_gets_the_scalars(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from impala.metrics import RunLog

    runlog = RunLog(tmp_path)
    monkeypatch.setattr(runlog, "_write_csv", _disk_full)
    for step in (10, 20):
        runlog.scalars(step, {"charts/SPS": float(step)})
    runlog.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "Could not write logs.csv" in errors[0] and "training goes on" in errors[0]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("charts/SPS")] == [(10, 10.0), (20, 20.0)]


class _FakeActor:
    pid = 1234

    def __init__(self) -> None:
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_paused_main_process_does_not_take_its_actors_for_hung() -> None:
    """After Ctrl-Z and fg every actor was silent, but so was the monitor: nobody is killed, all get a new
    grace period. An actor silent while the monitor ran is killed."""
    now = time.monotonic()
    actors = [_FakeActor(), _FakeActor()]
    run = types.SimpleNamespace(config=Config(actor_timeout_s=10), processes=actors, last_hang_check=now - 600,
                                heartbeats=[now - 600, now - 600], oom_kills=actor_pool.OomKills())
    LocalActorPool.kill_hung(run)
    assert not any(actor.killed for actor in actors)
    assert all(beat >= now for beat in run.heartbeats)
    run.heartbeats[1] = now - 60  # silent for a minute while the monitor kept checking
    LocalActorPool.kill_hung(run)
    assert [actor.killed for actor in actors] == [False, True]


def test_a_learner_hung_inside_an_update_ends_the_process_with_its_stack_keeping_the_last_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A learner stuck inside an update holds the update lock, on which the monitor and the shutdown wait: without
    --learner_timeout_s such a run stalls for good, and no SIGTERM ends it. With it, the process ends with code 1,
    the stuck thread's stack and the last checkpoint, as after a kill -9, from which a run resumes. A run stopped
    (SIGSTOP) for longer than the timeout in the middle of an update is not taken for hung when it goes on."""
    env = "hanging_learner_env:HangingLearnerCartPole-v1"  # not imported here: it would make this process's learner hang
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))  # for the env's module, in every process of the run
    monkeypatch.setenv("SLOW_UPDATE_S", "0.5")  # the learner is nearly always inside an update
    monkeypatch.setenv("HANG_AFTER", "14")
    run = Training(tmp_path, "hang", "--env", env, "--checkpoint_interval_s", "0.2", "--learner_timeout_s", "3",
                   "--log_interval_s", "0.2", total_steps=10_000_000)
    try:
        run.wait_for(r"Saved checkpoint at step [1-9]")
        os.killpg(run.pgid, signal.SIGSTOP)
        time.sleep(5)
        mark = len(run.text())
        os.killpg(run.pgid, signal.SIGCONT)
        run.wait_for(r"Saved checkpoint at step [1-9]", after=mark)  # it went on (this fails if the run ended)
        assert run.wait(timeout=60) == 1, run.text()
        assert wait_until_gone(run.pgid, timeout=30) == []  # actors and the fork server left with it
    finally:
        run.close()
    text = run.text()
    assert re.search(r"The learner-0 thread has spent \d+ s on one batch \(--learner_timeout_s 3\): a hung GPU or "
                     r"driver, or a deadlock\. Ending the process now, without a final checkpoint \(the one at step "
                     r"\d+ is intact\); run it again to resume\. Where the thread is:", text), text
    assert "in _finish_update_then_hang" in text  # the stuck thread's stack
    saved = checkpoint_step(run.run_dir)
    assert 0 < saved <= 14 * 20  # saved before the hang: 14 updates of SMALL_RUN's 20 agent steps at most
    assert (run.run_dir / "out.log").read_text().count("Ending the process now") == 1
    # Its checkpoints left as a kill -9 leaves them, which a run resumes from (test_a_killed_main_process_...); its
    # end recorded, so that the next start does not take it for killed.
    meta = json.loads((run.run_dir / "meta.json").read_text())
    assert meta["end_reason"] == "hung" and meta["ended"] is not None and meta["checkpoint_step"] == saved


def test_a_central_inference_thread_hung_inside_a_batch_ends_the_process_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its actors wait for actions, which counts as progress for them, and the learner waits for their slots: a hung
    inference thread stalled the run as silently as a hung learner."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))
    monkeypatch.setenv("HANG_IN", "inference")
    monkeypatch.setenv("HANG_AFTER", "200")
    run = Training(tmp_path, "hang", "--env", "hanging_learner_env:HangingLearnerCartPole-v1", "--inference",
                   "central", "--learner_timeout_s", "2", total_steps=10_000_000)
    try:
        assert run.wait(timeout=60) == 1, run.text()
        assert wait_until_gone(run.pgid, timeout=30) == []
    finally:
        run.close()
    text = run.text()
    assert re.search(r"The inference thread has spent \d+ s on one batch \(--learner_timeout_s 2\)", text), text
    assert "in _act_on_then_hang" in text


def test_a_learner_out_of_device_memory_ends_the_run_in_one_line_naming_the_flags_with_a_final_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a bug but sizes too big for the GPU (the ResNet with a big batch): no traceback, the flags that make an
    update smaller, and a final checkpoint (the weights are whole), from which the run resumes."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))
    monkeypatch.setenv("HANG_IN", "oom")
    monkeypatch.setenv("HANG_AFTER", "10")
    run = Training(tmp_path, "oom", "--env", "hanging_learner_env:HangingLearnerCartPole-v1",
                   "--checkpoint_interval_s", "0.1", total_steps=10_000_000)
    try:
        assert run.wait(timeout=60) == 1, run.text()
    finally:
        run.close()
    text = run.text()
    line = ("run.py: training failed: the learner ran out of memory on cpu (CUDA out of memory. Tried to allocate "
            "2.00 GiB): a smaller update "
            "fits, with a lower --batch_size or --unroll_length, or more --minibatches")
    assert [row for row in text.splitlines() if row.startswith("run.py:")] == [line], text
    assert "Traceback" not in text, text
    ended = re.search(r"Run ended \(error\) at step (\d+)", text)
    assert ended and 0 < int(ended[1]) <= 10 * 20, text  # 10 updates of 20 agent steps at most
    assert checkpoint_step(run.run_dir) == int(ended[1])  # the final checkpoint, at the step it ended


def test_a_build_that_fails_after_the_run_files_were_written_records_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure late in the build (here central inference's servers; the GPU out of memory would do) ends the
    session it began as an error in meta.json, not as the open session a kill leaves, and closes its logs."""
    def no_servers(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(training, "InferenceServers", no_servers)
    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=5, batch_size=4,
                    hidden_size=16, total_steps=100, disable_cuda=True, inference="central",
                    savedir=str(tmp_path), xpid="late")
    with pytest.raises(RuntimeError, match="out of memory"):
        training.train(config)
    meta = json.loads((tmp_path / "late" / "meta.json").read_text())
    assert meta["end_reason"] == "error" and meta["final_step"] == 0 and meta["ended"] is not None
    events = EventAccumulator(str(tmp_path / "late"))  # the writer closed: the run's flags are in its file
    events.Reload()
    assert "flags/text_summary" in events.Tags()["tensors"]


@pytest.mark.parametrize("stopping", ["the evaluator", "the actors"])
def test_a_fault_in_stopping_the_evaluator_or_the_actors_comes_after_the_final_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopping: str) -> None:
    """A fault while stopping (a lost Ray connection, an evaluator's bug) ends the run as an error, its final
    checkpoint saved first."""
    if stopping == "the evaluator":
        def failing_stop(run: object) -> None:
            raise RuntimeError("the evaluator's fault")

        monkeypatch.setattr(training, "stop_evaluator", failing_stop)
    else:
        stop = LocalActorPool.stop

        def stop_then_fail(pool: LocalActorPool, drain: object) -> None:
            stop(pool, drain)
            raise RuntimeError("the actors' fault")

        monkeypatch.setattr(LocalActorPool, "stop", stop_then_fail)
    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=5, batch_size=4,
                    hidden_size=16, total_steps=200, disable_cuda=True, savedir=str(tmp_path), xpid="eval-fault")
    with pytest.raises(RuntimeError, match="fault"):
        training.train(config)
    assert checkpoint_step(tmp_path / "eval-fault") == 200  # saved before the fault was raised
    assert json.loads((tmp_path / "eval-fault" / "meta.json").read_text())["end_reason"] == "error"


def test_a_learner_that_fails_while_being_stopped_leaves_the_last_checkpoint_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether to save is decided again once the learners have stopped: one that failed meanwhile may have left
    the weights half updated."""
    stop = Learners.stop

    def stop_with_a_failure(learners: Learners, timeout_s: float) -> None:
        stop(learners, timeout_s)
        learners.errors.append(RuntimeError("failed in its last update"))

    monkeypatch.setattr(Learners, "stop", stop_with_a_failure)
    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=5, batch_size=4,
                    hidden_size=16, total_steps=200, disable_cuda=True, savedir=str(tmp_path), xpid="late-fault")
    training.train(config)
    assert "Not saving a final checkpoint: a learner thread failed while stopping (no checkpoint saved yet)" \
        in (tmp_path / "late-fault" / "out.log").read_text()
    assert not (tmp_path / "late-fault" / "model.tar").exists()


def test_a_learner_that_fails_after_the_run_ended_but_before_the_stop_says_why_nothing_is_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault between the end (its total, or a signal) and the learners' stop: the run still ends as it was
    ending, and the missing final checkpoint is said, not left to be guessed from the exit code."""
    monitor = training.monitor

    def monitor_then_a_fault(run: training.Run) -> str:
        reason = monitor(run)
        run.learners.errors.append(RuntimeError("failed in its last update"))
        return reason

    monkeypatch.setattr(training, "monitor", monitor_then_a_fault)
    training.train(_small_run(tmp_path, "end-fault", total_steps=200))
    assert "Not saving a final checkpoint: a learner thread failed while stopping (no checkpoint saved yet)" \
        in (tmp_path / "end-fault" / "out.log").read_text()
    assert not (tmp_path / "end-fault" / "model.tar").exists()


def test_a_crash_of_the_main_process_prints_where_its_threads_were(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A segfault in the main process (here in the env the run probes; a GPU driver's in the learner would do as
    well) prints the Python stack of every thread before the process dies, not a bare "Segmentation fault"."""
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))
    result = run_py("--env", crashing_env.SEGFAULTING_ENV, "--savedir", str(tmp_path), "--disable_cuda")
    assert result.returncode == -signal.SIGSEGV, result.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in result.stderr, result.stderr[-3000:]
    assert re.search(r"File \".*crashing_env\.py\", line \d+ in __init__", result.stderr), result.stderr[-3000:]
    assert re.search(r"File \".*impala/environment\.py\", line \d+ in probe_env", result.stderr), result.stderr[-3000:]
