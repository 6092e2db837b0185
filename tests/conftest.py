"""What every test is held to, beside its own assertions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from process_helpers import README_CARTPOLE, README_CARTPOLE_STEPS, run_py


def _runs_project_code(thread: threading.Thread) -> bool:
    """A thread whose target is a function of this project (impala or its tests), not a library's own."""
    target = getattr(thread, "_target", None)
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in ("impala", "tests") or module.startswith("test_")


@pytest.fixture(autouse=True)
def no_thread_of_the_project_left_running() -> Iterator[None]:
    """A thread that a test starts and never stops keeps using the CPU under every later test: one inference
    server left serving closed pipes once took a core away from the second half of the suite."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive() and _runs_project_code(t)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"threads left running by the test: {[t.name for t in left]}"


@pytest.fixture(autouse=True)
def torch_threads_as_they_were() -> Iterator[None]:
    """A test that sets torch's intra-op threads (a build does, as a run's process would) leaves every later test
    its own count, not one thread."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def event_files_numbered_from_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard names an event file by its second, then by how many writers this process made before: with
    ten or more (earlier tests' runs in this process), a test's ".10" file sorts before its ".9" one made in the
    same second, and a reader applies a resume's purge out of order. A run's process is young; each test too."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))


@pytest.fixture
def cpp_compiler() -> None:
    """Skips a test of --compile on the CPU where torch finds no C++ compiler (a slim image) or Python's headers are
    missing, which run.py refuses in one line (tests/test_bad_input.py); it runs wherever both are found."""
    from impala import learner
    from impala.config import UserError

    try:
        learner.check_compiler(torch.device("cpu"))
    except UserError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def readme_cartpole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The savedir of one run of the README's CartPole command to its end (xpid "cartpole"), trained once for
    every test that reads it (1-1.5 minutes on two cores). Tests that change the run copy it first."""
    savedir = tmp_path_factory.mktemp("readme-cartpole")
    result = run_py(*README_CARTPOLE, "--total_steps", str(README_CARTPOLE_STEPS), "--savedir", str(savedir),
                    "--xpid", "cartpole", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return savedir
