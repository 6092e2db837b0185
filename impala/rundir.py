"""The run directory, SAVEDIR/XPID: where it is, whether it resumes a run (and from which checkpoint), and
the files that explain it (flags.json, meta.json with versions, commit, learner ranks, start and end, and
the `latest` file beside it).

`SAVEDIR/latest` is a one-line text file naming the run started or resumed last, not a symlink: TensorBoard
follows a symlinked directory and listed every run twice. `--xpid latest` reads it (`config.run_path`)."""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import itertools
import json
import logging
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import torch

from impala.checkpoint import (
    CHECKPOINT_NAME,
    check_compatible,
    eval_seeds_used,
    find_checkpoint,
    link_or_copy,
    load_checkpoint,
    remove_stale_temporaries,
)
from impala.config import (
    LATEST_NAME,
    MAX_ENV_NAME_CHARS,
    Config,
    UserError,
    expand_flag_files,
    plain_name,
    run_path,
    torchrun_run_id,
)
from impala.metrics import move_aside
from impala.seeding import ActorLives

log = logging.getLogger("impala")
META_NAME = "meta.json"
LOG_NAME = "out.log"  # the console log
# What a process killed mid-write leaves in a run directory: `_write_json`'s, `RunLog`'s and `events.purge_events`'s
# files before their rename, and the probe of `prepare_run_directory`.
_TEMPORARY_GLOBS = (".*.json.tmp-*", "logs.csv.tmp", ".write-test-*", ".events-purge-*.tmp")


class NameTaken(Exception):
    """Another training made the directory of the default name this one chose (both started in the same
    second): `training.train` builds the run again, which chooses the next free name."""


def run_directory(config: Config) -> tuple[Path, bool]:
    """The run's directory and whether it resumes an existing run. Writes nothing.

    Without --xpid the name is ENV-date-time, or ENV-date-time-N where that is taken: a new run, whatever is in
    SAVEDIR (ENV: the env id as a plain name, its first MAX_ENV_NAME_CHARS characters). `prepare_run_directory`
    claims it."""
    if config.xpid is None:
        base = f"{plain_name(config.env)[:MAX_ENV_NAME_CHARS]}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        names = (base if n == 1 else f"{base}-{n}" for n in itertools.count(1))
        run_dir = next(path for name in names if not os.path.lexists(path := run_path(config.savedir, name)))
    else:
        run_dir = run_path(config.savedir, config.xpid)
    return run_dir, resume_checkpoint(config, run_dir) is not None


class DirectoryLock:
    """A training's hold on its run directory, from before it reads the checkpoint until the run has ended: a
    second training of the same run (launched twice, or restarted by a process manager while the first still
    stops) is refused with one line, instead of both writing model.tar, logs.csv and meta.json over each other.

    An exclusive `flock` on the directory itself, so taking it writes nothing; the kernel drops it when the
    process ends, however it ends (kill -9 included), and no child holds it: the file descriptor is closed
    across exec, and actors and the evaluator come from the fork server, which was started by one.
    """

    def __init__(self) -> None:
        self.path: Path | None = None
        self._fd: int | None = None
        self._cannot_lock: Path | None = None  # a directory whose file system keeps no locks: said once

    def hold(self, run_dir: Path) -> None:
        """Lock `run_dir` (an existing directory); raises UserError when another training holds it."""
        if self._fd is not None:
            if self.path != run_dir:
                raise RuntimeError(f"already holding {self.path}, asked for {run_dir}")
            return
        if run_dir == self._cannot_lock:
            return
        try:
            fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UserError(f"cannot open the run directory {run_dir}: {exc.strerror or exc}; choose another "
                            "--savedir or --xpid") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"run directory {run_dir} is in use by another training (running or still stopping); "
                            "wait for it to end, or choose another --xpid") from None
        except OSError as exc:  # a file system that keeps no locks (ENOLCK, EOPNOTSUPP: some network or FUSE mounts)
            os.close(fd)
            self._cannot_lock = run_dir
            log.warning("Could not lock the run directory %s (%s): a second training of this run would not be refused "
                        "while this one runs", run_dir, exc.strerror or exc)
            return
        self.path, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the lock releases it
            self.path, self._fd = None, None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def open_run(config: Config, model: str, observation_shape: tuple[int, ...], num_actions: int,
             lock: DirectoryLock | None = None) -> tuple[Path, bool, Path | None, dict[str, Any] | None]:
    """(run directory, whether it resumes a run, the checkpoint to start from and its content), refusing a
    checkpoint that does not fit the model (--model `model`, its shapes) or that already reached
    --total_steps, and a run directory that another training holds (`lock` takes it first, where the
    directory exists). Writes nothing."""
    run_dir, resuming = run_directory(config)
    if lock is not None and config.xpid is not None and run_dir.is_dir():  # a default name is new: claimed later
        lock.hold(run_dir)  # before its checkpoint is read: another training may be writing it
    if config.resume and not resuming:
        named = (f"; under torchrun the run's default name {run_dir.name} comes from its rendezvous id, a new one in "
                 "each launch with --standalone: pass --xpid NAME of the run to continue"
                 if torchrun_run_id() is not None and run_dir.name.endswith(plain_name(str(torchrun_run_id()))) else "")
        raise UserError(f"--resume: no checkpoint at {run_dir / CHECKPOINT_NAME} to continue from; "
                        f"drop --resume to start a new run{named}")
    checkpoint_path = resume_checkpoint(config, run_dir)  # model.tar, or --checkpoint best|PATH
    if (checkpoint_path is not None and config.checkpoint not in ("latest", "best")
            and not os.path.lexists(Path(config.checkpoint).expanduser())):  # a PATH gone: only `start_gone` passes
        log.warning("%s was this run's start and is gone since (--keep_checkpoints prunes the run's own copies): it "
                    "continues from its own %s", config.checkpoint, checkpoint_path)
    if checkpoint_path is None:
        if config.xpid is not None and restarts_unsaved_run(config, run_dir):
            return run_dir, True, None, None  # its meta.json and logs go on, from step 0
        return run_dir, resuming, None, None

    def fitting(path: Path) -> dict[str, Any]:
        checkpoint = load_checkpoint(path)
        check_compatible(checkpoint, env=config.env, model=model, use_lstm=config.use_lstm,
                         hidden_size=config.hidden_size, observation_shape=observation_shape,
                         num_actions=num_actions, path=path)
        return checkpoint

    checkpoint = fitting(checkpoint_path)
    if repeated_start(run_dir, checkpoint_path, checkpoint["step"]):
        own = run_dir / CHECKPOINT_NAME
        log.warning("%s (step %s) was this run's start already and the run has gone on from it: it continues from "
                    "its own %s (to go back to that checkpoint once more, pass a copy of it)", checkpoint_path,
                    checkpoint["step"], own)
        checkpoint_path, checkpoint = own, fitting(own)
    if int(checkpoint["step"]) >= config.total_steps:
        whose = f"run {run_dir}" if is_own_checkpoint(run_dir, checkpoint_path) else f"checkpoint {checkpoint_path}"
        raise UserError(f"{whose} already reached step {checkpoint['step']} of --total_steps "
                        f"{config.total_steps}; pass a larger --total_steps to train it further")
    _go_on_numbering(checkpoint, run_dir, checkpoint_path, config.eval_episodes)
    return run_dir, resuming, checkpoint_path, checkpoint


# Numbers that seed games: a run that goes back to an earlier checkpoint of its own (--checkpoint best or PATH) goes
# on from the highest its model.tar reached, so no actor life and no evaluation plays games the run played before.
_SEED_COUNTERS = (*ActorLives.KEYS, "evaluations", "eval_seeds_used")


def _go_on_numbering(checkpoint: dict[str, Any], run_dir: Path, checkpoint_path: Path, eval_episodes: int) -> None:
    current = run_dir / CHECKPOINT_NAME
    if not current.is_file() or current.resolve() == checkpoint_path.resolve():
        return
    try:
        own = load_checkpoint(current, mmap=True)
        highest = {key: int(own.get(key, 0)) for key in _SEED_COUNTERS}
        highest["eval_seeds_used"] = eval_seeds_used(own, eval_episodes)  # saved before the count too
        if isinstance(checkpoint.get("evaluations", 0), int):
            checkpoint["eval_seeds_used"] = eval_seeds_used(checkpoint, eval_episodes)
    except (UserError, TypeError, ValueError):  # damaged: nothing to go on from (it is kept aside all the same)
        return
    for key, value in highest.items():
        if isinstance(checkpoint.get(key, 0), int):  # else the load refuses the checkpoint
            checkpoint[key] = max(checkpoint.get(key, 0), value)


def restarts_unsaved_run(config: Config, run_dir: Path) -> bool:
    """Whether `run_dir`, which has no checkpoint to continue from, holds the files of a run that was killed
    before its first checkpoint (a `kill -9`, a power cut, a process manager restarting the command): True, and
    that run starts again from step 0 keeping its meta.json (its starts), its events and CSV rows dropped.
    A UserError, before anything is written, where starting afresh would lose what it saved: kept checkpoints
    without model.tar (moved away: the next --keep_checkpoints would delete them), or another env's run."""
    if not run_dir.is_dir():
        return False
    checkpoint = run_dir / CHECKPOINT_NAME
    if os.path.lexists(checkpoint):  # not a file: a directory, or a link to a file moved away
        raise UserError(f"{checkpoint} is not a checkpoint file (a directory, or a link to nothing): restore it, "
                        "or choose another --xpid")
    kept = sorted(run_dir.glob("model_step_*.tar"), key=lambda p: p.stat().st_mtime)
    if kept:
        raise UserError(f"run {run_dir} has no {CHECKPOINT_NAME} but keeps {kept[-1].name}: pass --checkpoint "
                        f"{kept[-1]} to continue from it, or choose another --xpid")
    saved_step = _recorded(run_dir, "checkpoint_step")
    if isinstance(saved_step, int) and not isinstance(saved_step, bool):
        raise UserError(f"run {run_dir} saved a checkpoint at step {saved_step} (its {META_NAME}) but has no "
                        f"{CHECKPOINT_NAME}: restore it, pass --checkpoint PATH to continue from a copy, or choose "
                        "another --xpid")
    flags_path = run_dir / "flags.json"
    if not flags_path.is_file():
        # Not out.log: a job scheduler may make it before the run starts (SLURM's --output).
        ours = [name for name in (META_NAME, "logs.csv") if (run_dir / name).exists()]
        if ours:  # a new run would write over them
            raise UserError(f"{run_dir} holds {', '.join(ours)} but no flags.json: not a run this program can "
                            "continue or start there; choose another --xpid")
        return False  # not a run's directory (or an empty one): a new run
    try:
        env = json.loads(flags_path.read_text()).get("env")
    except (OSError, ValueError, AttributeError):
        env = None  # cut short by the kill: the env cannot be told, and nothing in it is worth more than the rest
    if env is not None and env != config.env:
        raise UserError(f"run {run_dir} is a run of {env} (its flags.json; killed before its first checkpoint), "
                        f"not of {config.env}; choose another --xpid")
    log.warning("Run %s has no checkpoint (stopped before its first one): it starts again from step 0, its "
                "TensorBoard events and logs.csv rows dropped", run_dir)
    return True


START_KEY = "checkpoint_start"  # meta.json's record of the last start from another checkpoint than model.tar


def is_own_checkpoint(run_dir: Path, path: Path) -> bool:
    """Whether checkpoint `path` is the run's own model.tar (not --checkpoint best or another PATH)."""
    return path.resolve() == (run_dir / CHECKPOINT_NAME).resolve()


def record_start(run_dir: Path, start: Path, step: int) -> None:
    """Record in meta.json that a session of the run began from checkpoint `start` (--checkpoint best or PATH, not
    model.tar) at `step`, for `repeated_start`. Raises OSError."""
    _record(run_dir, START_KEY, {"checkpoint": str(start.resolve()), "step": step})


def repeated_start(run_dir: Path, start: Path, step: object) -> bool:
    """Whether checkpoint `start` (at `step`) is the one a session of this run already began from, and the run
    saved its own model.tar since: the same command run again (a job requeued, a process manager's restart)
    then continues the run, rather than going back to its start each time and dropping what came after."""
    if is_own_checkpoint(run_dir, start) or not (run_dir / CHECKPOINT_NAME).is_file():
        return False
    recorded = _recorded_start(run_dir, start)
    return recorded is not None and recorded.get("step") == step


def _recorded_start(run_dir: Path, start: Path) -> dict[str, Any] | None:
    """meta.json's record of the run's start (`record_start`) where it names checkpoint `start`, else None."""
    recorded = _recorded(run_dir, START_KEY)
    return recorded if isinstance(recorded, dict) and recorded.get("checkpoint") == str(start.resolve()) else None


def replaces_own_checkpoint(run_dir: Path, start: Path | None) -> bool:
    """Whether a run of `run_dir` continued from `start` replaces the directory's own model.tar by another."""
    current = run_dir / CHECKPOINT_NAME
    return start is not None and current.is_file() and current.resolve() != start.resolve()


def keep_replaced_checkpoint(run_dir: Path, start: Path | None) -> Path | None:
    """A run continued from another checkpoint than its own model.tar (--checkpoint best or PATH: a rewind, or a
    name reused by mistake) would replace that model.tar at its first checkpoint. It is kept first, as
    model_replaced_step_STEP.tar (a hard link where the file system allows), which --keep_checkpoints never
    prunes. Call once the run directory may be written; returns the copy made, if one was."""
    current = run_dir / CHECKPOINT_NAME
    if not replaces_own_checkpoint(run_dir, start):
        return None
    try:
        step = str(int(load_checkpoint(current, mmap=True)["step"]))
    except UserError:  # damaged: kept all the same, under the time it was written
        step = datetime.fromtimestamp(current.stat().st_mtime, UTC).strftime("unreadable-%Y%m%d-%H%M%S")
    target, number = run_dir / f"model_replaced_step_{step}.tar", 1
    while target.exists():  # kept by an earlier rewind: the same checkpoint, or another history's at that step
        if os.path.samefile(target, current) or filecmp.cmp(target, current, shallow=False):
            return None
        number += 1
        target = run_dir / f"model_replaced_step_{step}-{number}.tar"
    link_or_copy(current, target)
    log.info("This run's %s (step %s) is replaced from %s on: kept as %s", CHECKPOINT_NAME, step, start, target.name)
    return target


def resume_checkpoint(config: Config, run_dir: Path) -> Path | None:
    """The checkpoint a training run continues from: with `--checkpoint latest` (the default) the run's
    model.tar when there is one (else None: a new run); with best or a PATH that file, which must exist."""
    if config.checkpoint == "latest":
        path = run_dir / CHECKPOINT_NAME
        return path if path.is_file() else None
    if config.checkpoint != "best" and start_gone(config.checkpoint, run_dir):
        return run_dir / CHECKPOINT_NAME
    return find_checkpoint(run_dir, config.checkpoint, config.eval_actions)


def start_gone(choice: str, run_dir: Path) -> bool:
    """Whether --checkpoint `choice` (a PATH) is gone, recorded as this run's start (`record_start`), and the run
    has its own model.tar: a run's model_step_N.tar that --keep_checkpoints pruned since, in a command run again.
    The run then continues from its model.tar (`repeated_start`), rather than being refused for a missing file."""
    path = Path(choice).expanduser()
    if os.path.lexists(path) or not (run_dir / CHECKPOINT_NAME).is_file():
        return False
    return _recorded_start(run_dir, path) is not None


def prepare_run_directory(run_dir: Path, lock: DirectoryLock | None = None, claim: bool = False) -> bool:
    """Create `run_dir`, take `lock` on it (if `open_run` has not yet), prove it writable and remove temporaries
    of a write that was killed (a checkpoint's, meta.json's, logs.csv's). With `claim` (a name chosen by default) the directory must be new:
    NameTaken where another training made it first. Returns whether this call made the directory."""
    made = not run_dir.exists()
    try:
        if claim:
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            try:
                run_dir.mkdir()
            except FileExistsError:
                raise NameTaken(run_dir.name) from None
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
        if lock is not None:
            lock.hold(run_dir)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        if made and run_dir.is_dir():  # made here, then found unwritable (a quota, no inodes): not left behind
            remove_if_empty(run_dir)
        if run_dir.exists() and not run_dir.is_dir():  # a file of that name in SAVEDIR: the name is the fault
            raise UserError(f"cannot make the run directory {run_dir}: a file of that name is there; choose another "
                            "--xpid") from None
        above = next((parent for parent in run_dir.parents if parent.exists()), None)
        if above is not None and not above.is_dir():  # --savedir a file, or below one
            raise UserError(f"cannot make the run directory {run_dir}: {above} is not a directory; choose another "
                            "--savedir") from None
        raise UserError(f"cannot write the run directory {run_dir}: {exc.strerror or exc}; "
                        "choose another --savedir") from None
    try:  # the console log is opened once the run is built, when a failure would leave its start half-recorded
        if os.path.lexists(run_dir / LOG_NAME):  # else the probe above has shown that it can be made
            with open(run_dir / LOG_NAME, "a"):
                pass
    except OSError as exc:
        raise UserError(f"cannot write {run_dir / LOG_NAME}: {exc.strerror or exc}; move it out of the way") from None
    remove_stale_temporaries(run_dir)
    for pattern in _TEMPORARY_GLOBS:
        for tmp in run_dir.glob(pattern):
            tmp.unlink(missing_ok=True)
    return made


def remove_if_empty(run_dir: Path) -> None:
    """Remove `run_dir`, made by a start that then failed (a full disk), where it holds nothing but empty files."""
    with contextlib.suppress(OSError):
        files = list(run_dir.iterdir())
        if all(path.is_file() and not path.is_symlink() and path.stat().st_size == 0 for path in files):
            for path in files:
                path.unlink()
            run_dir.rmdir()


def write_run_files(config: Config, run_dir: Path, resuming: bool, world_size: int = 1) -> int:
    """flags.json, meta.json (versions, commit, start time, `world_size`: the learner ranks under torchrun,
    else 1) and the `latest` file beside the run.

    Returns this session's number: 0 for a new run, then one more for every start recorded in meta.json
    (a resumed session killed before its next checkpoint counts too). A directory that takes no more bytes (a
    full disk, a quota) is a UserError: nothing of the run can be kept there, and nothing in it has changed.
    """
    meta = read_meta(run_dir) if resuming else {}
    # Each session records its end; one killed before the run's first checkpoint is told of as it starts again.
    if meta.get("starts") and "ended" in meta and meta["ended"] is None and "checkpoint_step" in meta:
        log.warning("The last session of this run, started %s, never recorded its end: it was killed (kill -9, the "
                    "kernel's OOM killer, a machine lost or powered off) or crashed; what it did after the run's last "
                    "checkpoint (step %s) is not kept", meta["starts"][-1], meta["checkpoint_step"])
    meta = _session_started(meta, world_size)
    try:
        _write_json(run_dir / "flags.json", config.to_dict())
        _write_json(run_dir / META_NAME, meta)
    except OSError as exc:
        raise UserError(f"cannot write the run files in {run_dir}: {exc.strerror or exc}; free space there or "
                        "choose another --savedir") from None
    write_latest(run_dir)
    return len(meta["starts"]) - 1


def _session_started(meta: dict[str, Any], world_size: int) -> dict[str, Any]:
    """`meta` with this session's start, versions and command."""
    meta.setdefault("starts", []).append(datetime.now(UTC).isoformat(timespec="seconds"))
    meta.update(versions(), command=_command(), git_commit=git_commit(), world_size=world_size,
                ended=None, end_reason=None)
    return meta


def _command() -> str:
    """This program's command line for meta.json, with each @FILE replaced by its flags (the file may change)."""
    try:
        return " ".join([sys.argv[0], *expand_flag_files(sys.argv[1:])])
    except UserError:  # changed or gone since the flags were read: as it was typed
        return " ".join(sys.argv)


def remake_run_directory(config: Config, run_dir: Path, world_size: int) -> None:
    """Make `run_dir` again where it went while its run went on (deleted, or moved away): flags.json, a new record in
    meta.json (its one start is now: the earlier ones went with the old record) and `latest`. Raises OSError."""
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = _session_started({}, world_size)
    meta["remade"] = meta["starts"][-1]
    _write_json(run_dir / "flags.json", config.to_dict())
    _write_json(run_dir / META_NAME, meta)
    write_latest(run_dir)


def write_latest(run_dir: Path) -> None:
    """Name `run_dir` in SAVEDIR/latest (replacing a symlink left by older versions; never a run called latest)."""
    latest = run_dir.parent / LATEST_NAME
    if latest.is_dir() and not latest.is_symlink():
        return
    tmp = run_dir.parent / f"{LATEST_TMP_PREFIX}{os.getpid()}"
    try:
        tmp.write_text(run_dir.name + "\n")
        os.replace(tmp, latest)  # atomic: a reader sees the old name or the new one
    except OSError:  # the file is a convenience only; a full disk leaves no temporary file behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    _remove_stale_latest_files(run_dir.parent)


LATEST_TMP_PREFIX = ".latest-"  # + the writer's pid: SAVEDIR/latest's temporary file


STALE_LATEST_S = 60.0  # a temporary `latest` file this old is no writer's between its write and its rename


def _remove_stale_latest_files(savedir: Path) -> None:
    """Remove the temporary `latest` files of writers no longer running (killed between write and rename): of no
    process here, and a minute old (a SAVEDIR shared between machines holds other machines' writers' too)."""
    for path in savedir.glob(f"{LATEST_TMP_PREFIX}*"):
        pid = path.name.removeprefix(LATEST_TMP_PREFIX)
        with contextlib.suppress(OSError):
            if pid.isdigit() and not _running(int(pid)) and time.time() - path.stat().st_mtime > STALE_LATEST_S:
                path.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def finish_run_files(run_dir: Path, reason: str, step: int) -> None:
    """Record in meta.json when and why the run ended (finished, interrupted, terminated, hangup, error, hung) and
    its step."""
    meta = read_meta(run_dir)
    ended = datetime.now(UTC)
    meta.update(ended=ended.isoformat(timespec="seconds"), end_reason=reason, final_step=step)
    if meta.get("starts"):  # this session's length; a resumed run has one start per session
        meta["duration_s"] = round((ended - datetime.fromisoformat(meta["starts"][-1])).total_seconds())
    _write_json(run_dir / META_NAME, meta)


def record_best(run_dir: Path, best: dict[str, Any], kept: tuple[str, str] | None = None) -> None:
    """Record the best evaluation so far (step, mean and spread of its returns, its --eval_actions and its file) in
    meta.json, atomically: as `best_evaluation` (model_best.tar's) and, with the other actions' best,
    in `best_evaluations`. `kept`: the actions and file name of the other kind's best where it was just kept aside
    (`checkpoint.keep_other_best`) for this one."""
    meta = read_meta(run_dir)
    earlier, bests = meta.get("best_evaluation"), meta.get("best_evaluations")
    bests = bests if isinstance(bests, dict) else {}
    if kept is not None:
        other, name = kept
        record = bests.get(other, earlier)  # a run from before `best_evaluations`: model_best.tar's was that one
        if isinstance(record, dict) and record.get("actions") == other:
            bests[other] = {**record, "checkpoint": name}
    meta["best_evaluation"] = best
    if isinstance(actions := best.get("actions"), str):
        meta["best_evaluations"] = {**bests, actions: best}
    _write_json(run_dir / META_NAME, meta)


def _recorded(run_dir: Path, key: str) -> Any:
    """`key` of the run's meta.json, or None where it has none or the file cannot be read (nothing is moved)."""
    try:
        meta = json.loads((run_dir / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    return meta.get(key) if isinstance(meta, dict) else None


def record_checkpoint(run_dir: Path, step: int) -> None:
    """Record in meta.json that the run saved a checkpoint (model.tar) at `step`: a run whose model.tar is then
    lost is refused rather than started again from step 0 over its logs (`restarts_unsaved_run`)."""
    _record(run_dir, "checkpoint_step", step)


def _record(run_dir: Path, key: str, value: Any) -> None:
    """`key` set to `value` in meta.json, atomically."""
    meta = read_meta(run_dir)
    meta[key] = value
    _write_json(run_dir / META_NAME, meta)


def read_meta(run_dir: Path) -> dict[str, Any]:
    """The run's record in meta.json; {} when it has none yet.

    A record that cannot be read (cut short by a full disk or a kill while an older version wrote it in place)
    must not stop a run that has a good checkpoint from resuming: it is moved aside, never overwritten, to
    meta.json.unreadable (-1, -2, ... when that exists), with a warning, and the run keeps a new record. Its
    earlier starts are lost with it, so sessions count from 0 again (seeding.py: the actor lives, numbered in
    the checkpoint, still never repeat).
    """
    path = run_dir / META_NAME
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError and undecodable bytes
        problem: str | None = f"{type(exc).__name__}: {exc}"
    else:
        problem = _meta_problem(meta)
        if problem is None:
            return meta
    aside = move_aside(path)
    log.warning("%s could not be read (%s); moved to %s, and the run goes on with a new record (its earlier "
                "starts are lost)", path, problem, aside.name)
    return {}


def _meta_problem(meta: Any) -> str | None:
    """What makes `meta` (meta.json, parsed) a record this module cannot go on (hand-edited, or another
    program's file), or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    if not isinstance(meta.get("starts", []), list):  # each start appends this session's time to it
        return "its \"starts\" is not a list"
    return None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """`value` as JSON in `path`, atomically: a kill or a full disk while writing leaves the previous file whole."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(value, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def versions() -> dict[str, str]:
    import ale_py
    import gymnasium
    import numpy

    return {"python": platform.python_version(), "torch": torch.__version__, "gymnasium": gymnasium.__version__,
            "ale_py": ale_py.__version__, "numpy": numpy.__version__}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
