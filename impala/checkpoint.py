"""Checkpoints: written atomically, loaded as data only, checked against the run that loads them.

A checkpoint is a dict of tensors and plain values (model, optimiser and schedule state, step
counters, flags, the returns of the last 100 games). It is written to a temporary file in the same directory, flushed to disk and renamed
over the old one, so a kill at any instant leaves either the old or the new checkpoint, never a torn
one. It is loaded with `torch.load(weights_only=True)`: a checkpoint is data and can never run code.
"""

from __future__ import annotations

import errno
import math
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from impala.config import EVAL_ACTIONS, Config, UserError, first_line

if TYPE_CHECKING:
    from impala.model import Net

CHECKPOINT_NAME = "model.tar"
BEST_CHECKPOINT_NAME = "model_best.tar"  # the agent of the best evaluation so far
BEST_FIX = "restore it, or move it away to start a new best"  # for a best checkpoint that cannot be read
STEP_CHECKPOINT_PATTERN = re.compile(r"model_step_(\d+)\.tar")  # periodic copies kept with --keep_checkpoints
_TEMPORARY_GLOB = ".*.tar.tmp-*"  # what `save_checkpoint` and `link_or_copy` write before their rename


# What a file system that cannot sync a directory answers (some network and FUSE ones): the checkpoint is written and
# renamed by then, durable as far as that file system makes renames durable, so this is not a failed save.
_NO_DIRECTORY_FSYNC = (errno.EINVAL, errno.EOPNOTSUPP)


def header(config: Config, model: Net) -> dict[str, Any]:
    """What every checkpoint holds beside its state: the run's flags, and the model and shapes that
    `check_compatible` compares with the run that loads it."""
    return {"flags": config.to_dict(), "model": model.model, "observation_shape": list(model.observation_shape),
            "num_actions": model.num_actions}


class _KeepsWriteError:
    """The file `torch.save` writes through, keeping the OSError of a write that failed: torch reports it as a
    RuntimeError ("unexpected pos"), which is what a disk with room for part of the file gives."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically (temporary file, fsync, rename, fsync of the directory). A failed write
    (a full disk) is an OSError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _KeepsWriteError(f)
            try:
                torch.save(state, writer)  # type: ignore[arg-type]  # a writable file, as torch uses one
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after an error; a kill here leaves it to remove_stale_temporaries
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_FSYNC:
            raise
    finally:
        os.close(directory)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete temporaries that a killed `save_checkpoint` left in `directory`; returns what was deleted.

    Call only while no other process writes checkpoints to `directory`.
    """
    removed = []
    for tmp in Path(directory).glob(_TEMPORARY_GLOB):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def load_checkpoint(path: str | os.PathLike, mmap: bool = False,
                    fix: str = "restore it or start a new run with another --xpid") -> dict[str, Any]:
    """Load a checkpoint as data (`weights_only=True`); with `mmap`, its tensors mapped from the file rather than
    read into memory (for a look at its counters: a second copy of a large model's weights and moments could
    take the memory its training needs).

    A missing, truncated, garbage or foreign file raises UserError with one line naming the file and the fix (for
    an unreadable one, `fix`).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}; train a run with this --xpid first (or check --savedir)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:  # there a moment ago: not damaged, gone
        raise UserError(f"checkpoint {path} went away as it was opened (deleted or moved: --keep_checkpoints of a "
                        "run still training prunes its oldest model_step_N.tar); pass another") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for truncated, garbage or unsafe files
        if not zipfile.is_zipfile(path):  # a JSON or CSV file of the run, say: torch's own words are no help there
            reason = "not the archive torch.save writes"
        elif isinstance(exc, pickle.UnpicklingError):  # not torch's advice to load it unsafely
            reason = "it holds objects other than tensors and plain data, which are never loaded"
        else:
            reason = first_line(exc)[:200]
        raise UserError(f"checkpoint {path} is not a readable checkpoint ({reason}); it may be truncated "
                        f"or not a checkpoint: {fix}") from None
    required: dict[str, type | tuple[type, ...]] = {"model_state_dict": dict, "flags": dict, "step": int, "observation_shape": (list, tuple),
                "num_actions": int}
    if not isinstance(state, dict) or any(not isinstance(state.get(key), kind) for key, kind in required.items()):
        raise UserError(f"checkpoint {path} is not an impala checkpoint (no model, flags or step counters in it)")
    if state["num_actions"] < 1 or not all(isinstance(size, int) and size >= 1 for size in state["observation_shape"]):
        raise UserError(f"checkpoint {path} is not an impala checkpoint (its model has {state['num_actions']} actions "
                        f"and observations {tuple(state['observation_shape'])})")
    if isinstance(state["step"], bool) or state["step"] < 0:  # True trained on "at step True"; -5 to step 2015
        raise UserError(f"checkpoint {path} is not an impala checkpoint (its step {state['step']!r} is not a count of "
                        "agent steps)")
    if not mmap:  # mapped: a look at the counters, the weights not used
        for key, tensor in state["model_state_dict"].items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.isfinite().all():
                raise UserError(f"checkpoint {path} is damaged: its weights {key} are not all finite numbers; use "
                                "another checkpoint")
    hidden_size = state["flags"].get("hidden_size")  # older checkpoints may have none: the run's own is used
    if hidden_size is not None and (not isinstance(hidden_size, int) or isinstance(hidden_size, bool)
                                    or hidden_size < 1):
        # Checked here, where every mode reads the file, before anything converts it.
        raise UserError(f"checkpoint {path} is not an impala checkpoint (its flags' hidden_size {hidden_size!r} is "
                        "not a whole number >= 1)")
    returns = state.get("recent_returns", [])  # the last 100 games' returns; older checkpoints have none
    if not isinstance(returns, list) or not all(isinstance(r, (int, float)) for r in returns):
        raise UserError(f"checkpoint {path} is not an impala checkpoint (its recent_returns are not a list of "
                        "numbers)")
    return state


def check_compatible(state: dict[str, Any], *, env: str, model: str, use_lstm: bool, hidden_size: int,
                     observation_shape: tuple[int, ...], num_actions: int, path: str | os.PathLike) -> None:
    """Refuse a checkpoint made for another env or model shape, saying which differs."""
    flags = state["flags"]
    differences = []
    if flags.get("env") != env:
        differences.append(f"env {flags.get('env')!r} vs {env!r}")
    if state.get("model") != model:
        differences.append(f"model {state.get('model')!r} vs {model!r}")
    if bool(flags.get("use_lstm")) != use_lstm:
        differences.append(f"use_lstm {flags.get('use_lstm')} vs {use_lstm}")
    if int(flags.get("hidden_size", hidden_size)) != hidden_size:
        differences.append(f"hidden_size {flags.get('hidden_size')} vs {hidden_size}")
    if tuple(state["observation_shape"]) != tuple(observation_shape):
        differences.append(f"observation shape {tuple(state['observation_shape'])} vs {tuple(observation_shape)}")
    if int(state["num_actions"]) != num_actions:
        differences.append(f"{state['num_actions']} actions vs {num_actions}")
    if differences:
        raise UserError(f"checkpoint {path} does not fit this run: " + "; ".join(differences)
                        + " (checkpoint vs flags); pass the run's own flags or use a new --xpid")


def eval_seeds_used(state: dict[str, Any], eval_episodes: int) -> int:
    """The evaluation seeds the run of checkpoint `state` handed out: its count, or, in a checkpoint saved before
    the count was kept, what its evaluations played then (evaluation n, from 1, the seeds n x --eval_episodes on;
    the checkpoint's own --eval_episodes, else `eval_episodes`). Raises TypeError or ValueError for a count that
    is not a number."""
    if "eval_seeds_used" in state:
        return int(state["eval_seeds_used"])
    evaluations = int(state.get("evaluations", 0))
    flags = state.get("flags")
    episodes = flags.get("eval_episodes", eval_episodes) if isinstance(flags, dict) else eval_episodes
    return (evaluations + 1) * int(episodes) if evaluations else 0


def find_checkpoint(run_dir: Path | None, choice: str, actions: str = "greedy") -> Path:
    """The file `--checkpoint CHOICE` names: latest (`run_dir`/model.tar), best (the best agent of evaluations with
    --eval_actions `actions`, `best_checkpoint`; where there is none of those, model_best.tar, else the other
    actions' best kept aside) or a path. UserError, one line, for a best or a path that is not there; a missing
    model.tar is left to `load_checkpoint`, whose message says to train the run first."""
    if choice == "latest" and run_dir is not None:
        return run_dir / CHECKPOINT_NAME
    if choice == "best" and run_dir is not None:
        other = next(kind for kind in EVAL_ACTIONS if kind != actions)
        for path in (best_checkpoint(run_dir, actions), run_dir / BEST_CHECKPOINT_NAME, kept_best(run_dir, other)):
            if path.is_file():  # the last: a kill between keeping it aside and the new best's save
                return path
        raise UserError(f"no {BEST_CHECKPOINT_NAME} in {run_dir}: no evaluation finished in that run "
                        "(train it with --eval_interval_s S), or use --checkpoint latest")
    path = Path(choice).expanduser()
    if path.is_dir():
        raise UserError(f"--checkpoint {choice} is a directory; pass a checkpoint file in it (such as "
                        f"{path / CHECKPOINT_NAME}), or name a run with --xpid")
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such file"  # /dev/null, a pipe
        raise UserError(f"--checkpoint {choice}: {what}; pass latest, best or the path of a checkpoint file")
    return path


def kept_best(run_dir: Path, actions: str) -> Path:
    """Where the best of evaluations with --eval_actions `actions` is kept while model_best.tar holds the other
    kind's (`keep_other_best`)."""
    return run_dir / f"model_best_{actions}.tar"


def best_checkpoint(run_dir: Path, actions: str) -> Path:
    """The file of `run_dir`'s best agent in evaluations with --eval_actions `actions` (greedy or sampled):
    model_best.tar where it records those actions (or none: a file from before they were recorded), else
    model_best_ACTIONS.tar, where a session evaluating with the other actions kept it (`keep_other_best`). The means
    of greedy and sampled evaluations are not compared: each kind has its own best. A model_best.tar that cannot be
    read is passed over for a kept file (it may be the other kind's), and raises UserError where there is none."""
    path, kept = run_dir / BEST_CHECKPOINT_NAME, kept_best(run_dir, actions)
    if path.is_file():
        try:
            recorded = best_eval_actions(path)
        except UserError:
            if kept.is_file():
                return kept
            raise
        if recorded in (None, actions):
            return path
    return kept if kept.is_file() or path.is_file() else path  # kept, and model_best.tar since gone: still the best


def keep_other_best(run_dir: Path, actions: str) -> Path:
    """model_best.tar, the best of evaluations with --eval_actions `actions`, renamed to model_best_ACTIONS.tar for a
    session of the other actions to take its place; returns the new name. Never over another file: where one of
    that name holds a better or unreadable agent, the new name is model_best_ACTIONS-N.tar (N = 1, 2, ...). One that
    model_best.tar beat (its clean-up, `_delete_beaten`, cut short by a kill) is replaced. Raises OSError."""
    path, kept = run_dir / BEST_CHECKPOINT_NAME, kept_best(run_dir, actions)
    if kept.is_file() and _beats(path, kept):
        os.replace(path, kept)
        return kept
    number = 0
    while os.path.lexists(kept):
        number += 1
        kept = run_dir / f"model_best_{actions}-{number}.tar"
    os.rename(path, kept)
    return kept


def _beats(path: Path, other: Path) -> bool:
    """Whether best checkpoint `path` scores at least as well as `other`; False where either cannot be read."""
    try:
        ours, theirs = best_so_far(path), best_so_far(other)
    except UserError:
        return False
    return ours is not None and theirs is not None and ours[0] >= theirs[0]


def best_so_far(path: Path) -> tuple[float, int] | None:
    """(mean evaluation return, agent step) recorded in best checkpoint `path` (`best_checkpoint`); None when
    there is none.

    The file itself is the record a resumed run compares against, so a best written just before a kill
    is never overwritten by a worse agent, whatever model.tar and meta.json say.
    """
    if not path.is_file():
        return None
    state = load_checkpoint(path, mmap=True, fix=BEST_FIX)
    score = state.get("eval_return_mean")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or math.isnan(score):
        raise UserError(f"{path} records no evaluation score (eval_return_mean {score!r}); {BEST_FIX}")
    return float(score), int(state["step"])


def best_eval_actions(path: Path) -> str | None:
    """The --eval_actions (greedy or sampled) of the evaluation best checkpoint `path` records; None without
    the file, or in one that does not say."""
    if not path.is_file():
        return None
    actions = load_checkpoint(path, mmap=True, fix=BEST_FIX).get("eval_actions")
    return actions if isinstance(actions, str) else None


def link_or_copy(source: Path, target: Path) -> None:
    """`source` also as `target` beside it: a hard link, which costs no copy and survives the next rename over
    `source`, or a copy where links are refused (some network or FUSE file systems). Made under a temporary name
    and renamed, so a kill never leaves a torn file."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def keep_step_copy(path: Path, step: int, keep: int) -> list[Path]:
    """Keep checkpoint `path` also as model_step_STEP.tar beside it (`link_or_copy`); delete all but the `keep`
    newest copies. "Newest" is by write time, not by step, so that a run resumed from an earlier checkpoint
    (--checkpoint best) keeps its new copies. Returns the deleted copies.
    """
    if keep <= 0:
        return []
    link_or_copy(path, path.with_name(f"model_step_{step}.tar"))
    copies = [p for p in path.parent.iterdir() if STEP_CHECKPOINT_PATTERN.fullmatch(p.name)]
    copies.sort(key=lambda p: (p.stat().st_mtime_ns, _step_of(p)))
    removed = copies[:-keep] if len(copies) > keep else []
    for old in removed:
        old.unlink(missing_ok=True)
    return removed


def _step_of(copy: Path) -> int:
    match = STEP_CHECKPOINT_PATTERN.fullmatch(copy.name)
    assert match is not None
    return int(match.group(1))
