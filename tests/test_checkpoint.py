"""Tests for impala/checkpoint.py: atomic writes survive a kill mid-write, loading is data-only, and a
checkpoint that does not fit is refused with a message naming the difference."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Self

import pytest
import torch

from impala.checkpoint import (
    CHECKPOINT_NAME,
    check_compatible,
    find_checkpoint,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from impala.config import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent


def _state(step: int) -> dict:
    return {"model_state_dict": {"w": torch.full((3,), float(step))}, "flags": {"env": "CartPole-v1",
            "use_lstm": False, "hidden_size": 32}, "step": step, "updates": step // 20, "model": "mlp",
            "observation_shape": [4], "num_actions": 2}


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_NAME
    save_checkpoint(path, _state(40))
    state = load_checkpoint(path)
    assert state["step"] == 40 and torch.equal(state["model_state_dict"]["w"], torch.full((3,), 40.0))
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]  # no temporary left


@pytest.mark.parametrize("error, saved", [(errno.EINVAL, True), (errno.EOPNOTSUPP, True), (errno.EIO, False)])
def test_a_file_system_that_cannot_sync_a_directory_still_saves(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, error: int, saved: bool) -> None:
    """Some network and FUSE file systems refuse fsync on a directory: the file is written and renamed by then, so
    that is no failed save; a real I/O error still is one."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / CHECKPOINT_NAME
    if saved:
        save_checkpoint(path, _state(40))
    else:
        with pytest.raises(OSError, match=os.strerror(errno.EIO)):
            save_checkpoint(path, _state(40))
    assert load_checkpoint(path)["step"] == 40  # written and renamed before the directory's sync either way
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


def test_a_kill_during_the_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_NAME
    save_checkpoint(path, _state(40))
    # A process that dies by SIGKILL in the middle of writing the next checkpoint, its bytes written, not synced.
    script = f"""
import os, signal, torch
from impala import checkpoint
def killed(fd):
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.os.fsync = killed
checkpoint.save_checkpoint({str(path)!r}, {{"step": 80}})
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=False)
    assert result.returncode == -9
    assert load_checkpoint(path)["step"] == 40
    stale = [p for p in tmp_path.iterdir() if p.name != CHECKPOINT_NAME]
    assert len(stale) == 1  # the torn temporary, never under the checkpoint's name
    assert remove_stale_temporaries(tmp_path) == stale
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


class _PartlyFullDisk:
    """A file on a disk with room for `room` more bytes: a write beyond them fails with ENOSPC, as the kernel's
    does; closing it does not fail."""

    def __init__(self, path: Path, room: int) -> None:
        self.file, self.room = open(path, "wb"), room  # noqa: SIM115 - closed by `close`

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_a_disk_with_room_for_part_of_the_checkpoint_is_an_oserror_that_keeps_the_last_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports a write that fails inside `torch.save` as a RuntimeError ("unexpected pos"): the callers
    catch OSError (a periodic save that fails is reported and training goes on), so the write must give it."""
    path = tmp_path / CHECKPOINT_NAME
    save_checkpoint(path, _state(40))
    monkeypatch.setattr("impala.checkpoint.open", lambda name, mode: _PartlyFullDisk(Path(name), room=1000),
                        raising=False)
    with pytest.raises(OSError) as failed:
        save_checkpoint(path, {**_state(80), "weights": torch.zeros(100_000)})
    assert failed.value.errno == errno.ENOSPC
    assert load_checkpoint(path)["step"] == 40
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_NAME]


@pytest.mark.parametrize("content", ["garbage", "truncated", "empty"])
def test_unreadable_files_are_a_one_line_user_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / CHECKPOINT_NAME
    if content == "garbage":
        path.write_bytes(os.urandom(4096))
    elif content == "truncated":
        save_checkpoint(path, _state(40))
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")
    with pytest.raises(UserError, match="is not a readable checkpoint") as error:
        load_checkpoint(path)
    assert "\n" not in str(error.value)


def test_a_checkpoint_deleted_as_it_is_opened_is_called_gone_not_damaged(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--keep_checkpoints of a run still training can prune a model_step_N.tar between the check that it is there
    and its opening: an intact file that went, not a truncated one."""
    path = tmp_path / "model_step_40.tar"
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # it was there at the check
    with pytest.raises(UserError) as error:
        load_checkpoint(path)
    assert str(error.value) == (f"checkpoint {path} went away as it was opened (deleted or moved: --keep_checkpoints "
                                "of a run still training prunes its oldest model_step_N.tar); pass another")


def test_loading_runs_no_code(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_NAME
    marker = tmp_path / "ran"
    # A pickle that would create `marker` if it were unpickled with full pickle.
    torch.save({"step": 1, "payload": _Exploit(str(marker))}, path)
    with pytest.raises(UserError, match="not a readable checkpoint") as error:
        load_checkpoint(path)
    assert not marker.exists()
    assert "holds objects other than tensors and plain data" in str(error.value)
    assert "weights_only" not in str(error.value)  # not torch's advice to load it unsafely


@pytest.mark.parametrize(("name", "text"), [("flags.json", '{"env": "CartPole-v1"}\n'), ("logs.csv", "step,a\n1,2\n")])
def test_another_file_of_a_run_is_named_as_not_a_checkpoint(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as error:
        load_checkpoint(tmp_path / name)
    assert str(error.value).startswith(f"checkpoint {tmp_path / name} is not a readable checkpoint (not the archive "
                                       "torch.save writes)"), error.value


def test_a_directory_given_as_a_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--checkpoint .* is a directory; pass a checkpoint file in it \(such as "
                                        r".*/model.tar\), or name a run with --xpid"):
        find_checkpoint(None, str(tmp_path))


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def test_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no checkpoint at"):
        load_checkpoint(tmp_path / CHECKPOINT_NAME)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.tar")
    with pytest.raises(UserError, match="not an impala checkpoint"):
        load_checkpoint(tmp_path / "other.tar")
    save_checkpoint(tmp_path / "returns.tar", {**_state(40), "recent_returns": [1.0, 2]})
    assert load_checkpoint(tmp_path / "returns.tar")["recent_returns"] == [1.0, 2]
    save_checkpoint(tmp_path / "returns.tar", {**_state(40), "recent_returns": ["21"]})
    with pytest.raises(UserError, match="recent_returns are not a list of numbers"):
        load_checkpoint(tmp_path / "returns.tar")


def test_a_checkpoint_for_another_env_or_shape_is_refused_saying_which() -> None:
    state = _state(40)
    kwargs = {"env": "CartPole-v1", "model": "mlp", "use_lstm": False, "hidden_size": 32,
              "observation_shape": (4,), "num_actions": 2, "path": "x/model.tar"}
    check_compatible(state, **kwargs)
    with pytest.raises(UserError, match=r"does not fit this run: env 'CartPole-v1' vs 'Acrobot-v1'; observation "
                                        r"shape \(4,\) vs \(6,\); 2 actions vs 3 \(checkpoint vs flags\)"):
        check_compatible(state, **{**kwargs, "env": "Acrobot-v1", "observation_shape": (6,), "num_actions": 3})
    with pytest.raises(UserError, match=r"does not fit this run: model 'mlp' vs 'shallow' \(checkpoint vs flags\)"):
        check_compatible(state, **{**kwargs, "model": "shallow"})
    with pytest.raises(UserError, match=r"does not fit this run: observation shape \(4,\) vs \(5,\) \(checkpoint"):
        check_compatible(state, **{**kwargs, "observation_shape": (5,)})
    with pytest.raises(UserError, match="hidden_size 32 vs 64"):
        check_compatible(state, **{**kwargs, "hidden_size": 64})
    with pytest.raises(UserError, match="use_lstm False vs True"):
        check_compatible(state, **{**kwargs, "use_lstm": True})
