"""Run `run.py` in its own process group and look at what it leaves behind (for the fault tests).

Every run gets a new session, so its process group holds run.py, the fork server, the resource tracker and
every actor, and nothing of another test's run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# The IMPALA rule (TorchBeast's loss and optimiser) that the README's CartPole command uses.
IMPALA_RULE = ("--policy_loss", "impala", "--optimizer", "rmsprop", "--epsilon", "0.01", "--grad_norm_clipping", "40",
               "--epochs", "1", "--minibatches", "1", "--vtrace_lambda", "1", "--lr_schedule", "linear")
# Small and quick: 20 agent steps per update, one learner thread.
SMALL_RUN = (*IMPALA_RULE, "--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "2", "--unroll_length", "5",
             "--batch_size", "4", "--num_learner_threads", "1", "--hidden_size", "32", "--learning_rate", "0.001",
             "--log_interval_s", "0.5")

# The README's CartPole command, less its --total_steps.
README_CARTPOLE = ("--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "4", "--unroll_length", "5",
                   "--batch_size", "8", "--learning_rate", "0.001", *IMPALA_RULE, "--entropy_cost", "0.01",
                   "--disable_cuda")
README_CARTPOLE_STEPS = 300_000


# For tests that reach Ray's own checks through run.py: without Ray (the README's test install) run.py stops first, at
# "--ray needs Ray".
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


def with_flags(args: tuple[str, ...], **values: str) -> tuple[str, ...]:
    """`args` with the value after each `--NAME` replaced by `values[NAME]`; every name must be in `args`."""
    out = list(args)
    for name, value in values.items():
        out[out.index(f"--{name}") + 1] = value
    return tuple(out)


# The README's torchrun CartPole command, less its --total_steps: each of two ranks has half the actors and half
# the batch, so the global batch is the single-process command's.
README_CARTPOLE_RANKS = with_flags(README_CARTPOLE, num_actors="1", batch_size="4")


def run_py(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python run.py ARGS` to completion, from the repository root."""
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def train_through_one_crash(savedir: Path, *flags: str) -> subprocess.CompletedProcess:
    """A small run of crashing_env's env to its end, in `savedir`/crash (PYTHONPATH must name tests/, where that
    module lives); asserts that it finished and that the crash's traceback reached the console once."""
    from crashing_env import ENV, MESSAGE  # registers the env here too; the run's processes import it by its id

    result = run_py(*SMALL_RUN, "--env", ENV, "--savedir", str(savedir), "--xpid", "crash", *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    console = result.stdout + result.stderr
    assert console.count(f"RuntimeError: {MESSAGE}") == 1, console
    assert console.count("Traceback (most recent call last)") == 1, console
    return result


@contextlib.contextmanager
def hangups_not_ignored() -> Iterator[None]:
    """SIGHUP at its default while processes start, so that they do not inherit `nohup`'s SIG_IGN from whoever runs
    the tests (a run started that way outlives a hangup by design: `stopping.stop_requests`)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


class Training:
    """A `run.py` training in the background, in its own session; `close()` kills whatever is left."""

    def __init__(self, savedir: Path, xpid: str, *args: str, total_steps: int = 1_000_000,
                 wrapper: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        """`wrapper`: a command that runs run.py, such as ("timeout", "600"); then `process` is the wrapper's.
        `env`: the process's environment, by default this one's."""
        self.savedir, self.xpid = savedir, xpid
        self.log_path = savedir / f"{xpid}.console"
        savedir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 - open for the life of the process
        self.process = subprocess.Popen(
            [*wrapper, sys.executable, "run.py", *SMALL_RUN, "--savedir", str(savedir), "--xpid", xpid,
             "--total_steps", str(total_steps), *args],
            cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.process.pid

    @property
    def run_dir(self) -> Path:
        return self.savedir / self.xpid

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, pattern: str, timeout: float = 90, after: int = 0) -> re.Match:
        """The first match of `pattern` in the console output from character `after` on (waits for it; fails if the
        run exits first). Its positions are those of the whole output."""
        deadline = time.monotonic() + timeout
        compiled = re.compile(pattern)
        while time.monotonic() < deadline:
            match = compiled.search(self.text(), after)
            if match:
                return match
            if self.process.poll() is not None:
                raise AssertionError(f"run exited ({self.process.returncode}) before {pattern!r}:\n{self.text()}")
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text()}")

    def wait_for_steps(self, steps: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [int(s.replace(",", "")) for s in re.findall(r"step ([\d,]+)/", self.text())]
            if done and max(done) >= steps:
                return
            if self.process.poll() is not None:
                raise AssertionError(f"run exited before step {steps}:\n{self.text()}")
            time.sleep(0.1)
        raise AssertionError(f"no step {steps} within {timeout} s:\n{self.text()}")

    def latest_step(self, after: int = 0) -> int:
        """The last step count the console printed (from character `after` of the output on); 0 if none."""
        done = [int(s.replace(",", "")) for s in re.findall(r"step ([\d,]+)/", self.text()[after:])]
        return max(done, default=0)

    def actor_pids(self) -> dict[int, int]:
        """The latest pid of every actor, from the "Actor N started (pid P)" lines."""
        return {int(i): int(p) for i, p in re.findall(r"Actor (\d+) started \(pid (\d+)\)", self.text())}

    def shm_inodes(self, pid: int | None = None) -> set[int]:
        """Inodes of the /dev/shm files the main process (or `pid`) has mapped now (semaphores, shared tensors).

        Inodes, not names: most are unlinked or renamed after mapping, and other runs share /dev/shm.
        """
        with open(f"/proc/{pid or self.process.pid}/maps") as f:
            return {int(line.split()[4]) for line in f if "/dev/shm/" in line}

    def wait(self, timeout: float = 60) -> int:
        return self.process.wait(timeout=timeout)

    def signal(self, signum: int, group: bool = False) -> None:
        if group:
            os.killpg(self.pgid, signum)
        else:
            self.process.send_signal(signum)

    def close(self) -> None:
        """Kill anything of the run still alive (a failed test must not leave processes behind)."""
        for pid in group_processes(self.pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log.close()


def group_processes(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def children(pid: int) -> list[int]:
    """The processes `pid` started (and has not lost), from /proc."""
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def runs_started_by(pid: int) -> list[int]:
    """The run.py processes that `pid` started."""
    runs = []
    for child in children(pid):
        try:
            if b"run.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                runs.append(child)
        except OSError:
            pass
    return runs


def sigterm_to_it_alone(launcher: subprocess.Popen, ready: Callable[[], bool]) -> tuple[str, list[str]]:
    """Once `ready()`, SIGTERM to `launcher` (started in a session of its own, its stderr piped), a program that
    starts run.py, and to it alone, as `kill PID` does: its stderr once it has exited, and the command line of the
    run.py it had started. Whatever is still running at the end, the run.py included, is stopped."""
    runs: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert time.monotonic() < deadline, "not ready within 90 s: the signal would not test a running run"
            time.sleep(0.2)
        runs = runs_started_by(launcher.pid)
        assert runs, "no run.py started"
        argv = Path(f"/proc/{runs[0]}/cmdline").read_bytes().decode().split("\0")
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in runs:  # a run left behind, stopped as the launcher should have stopped it
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return err, argv


def wait_until_gone(pgid: int, timeout: float = 30) -> list[int]:
    """Processes of group `pgid` still alive after up to `timeout` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = group_processes(pgid)
        if not left:
            return []
        time.sleep(0.2)
    return group_processes(pgid)


def shm_left(inodes: set[int]) -> list[str]:
    """Files still in /dev/shm with one of `inodes`."""
    left = []
    for path in Path("/dev/shm").iterdir():
        try:
            if path.stat().st_ino in inodes:
                left.append(str(path))
        except OSError:
            continue
    return left


def checkpoint_step(run_dir: Path) -> int:
    from impala.checkpoint import CHECKPOINT_NAME, load_checkpoint

    return int(load_checkpoint(run_dir / CHECKPOINT_NAME)["step"])


class Torchrun(Training):
    """`torchrun --standalone --nproc_per_node 2 run.py FLAGS` in the background, in its own session (so that
    `close` also ends ranks that torchrun, killed, would leave behind)."""

    def __init__(self, savedir: Path, xpid: str, *args: str, total_steps: int = 1_000_000,
                 flags: tuple[str, ...]) -> None:
        self.savedir, self.xpid = savedir, xpid
        self.log_path = savedir / f"{xpid}.console"
        savedir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 - open for the life of the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "run.py",
             *flags, "--savedir", str(savedir), "--xpid", xpid, "--total_steps", str(total_steps), *args],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.process.pid

    def rank_pid(self, rank: int) -> int:
        """The pid of the learner process of `rank` (a child of torchrun with RANK=rank in its environment)."""
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) \
                        != self.process.pid:
                    continue
                variables = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in variables:
                return int(entry.name)
        raise AssertionError(f"no rank {rank} among the children of torchrun:\n{self.text()}")
