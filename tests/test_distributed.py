"""Several learner processes (`impala/distributed.py`): two gloo ranks on the CPU, each with half of a batch,
make the update one learner makes with the whole batch; the replicas stay identical; a non-finite loss on
one rank makes both skip the step. Then `torchrun --standalone --nproc_per_node 2 run.py` as the user runs
it: SIGTERM to torchrun stops every rank in order with a checkpoint, kill -9 of a rank ends the job with
the last checkpoint kept, and (slow) CartPole learns as one run that test mode plays."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_helpers import (
    README_CARTPOLE_RANKS,
    REPO_ROOT,
    SMALL_RUN,
    Torchrun,
    checkpoint_step,
    needs_ray,
    run_py,
    wait_until_gone,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from impala import distributed, learner
from impala.config import Config, TrainingError, UserError, parse_config
from impala.distributed import MAX_GAMES_PER_VOTE, Coordinator, GradientReducer, Ranks
from impala.model import Net
from impala.seeding import ActorLives

T, B = 4, 3  # B unrolls per rank; the one-learner reference takes 2 x B
WORLD_SIZE = 2
OBSERVATION_SHAPE, NUM_ACTIONS = (4, 84, 84), 6
# RMSprop with TorchBeast's epsilon keeps the first step a smooth function of the gradient (Adam's first step is
# about lr * sign(g), which round-off can flip for a near-zero g), and clipping at 1 is active, so the test also
# shows the gradients are reduced before they are clipped.
BASE = Config(env="PongNoFrameskip-v4", unroll_length=T, batch_size=WORLD_SIZE * B, optimizer="rmsprop",
              epsilon=0.01, learning_rate=0.001, grad_norm_clipping=1.0, minibatches=1, total_steps=1_000_000,
              hidden_size=64)
CASES = {
    "shallow-impala": dataclasses.replace(BASE, policy_loss="impala", epochs=1, vtrace_lambda=1.0),
    "shallow-ppo": dataclasses.replace(BASE, policy_loss="ppo", epochs=2),
    "lstm-impala": dataclasses.replace(BASE, policy_loss="impala", epochs=1, use_lstm=True),
    "lstm-ppo": dataclasses.replace(BASE, policy_loss="ppo", epochs=2, use_lstm=True),
}


def _model(config: Config) -> Net:
    torch.manual_seed(1)
    return Net(OBSERVATION_SHAPE, NUM_ACTIONS, "shallow", config.use_lstm, config.hidden_size)


def _initial(config: Config) -> dict[str, torch.Tensor]:
    """The weights every rank and `_reference` start from, made with one torch thread as they are: the orthogonal
    initialisation's QR decomposition differs in its last bits with the thread count (1e-7 on the 2-core VM)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _model(config).state_dict()
    finally:
        torch.set_num_threads(threads)


def _whole_batch(config: Config, nan_in_column: int | None = None) -> tuple[dict[str, torch.Tensor], tuple]:
    """A fixed batch of 2 x B unrolls [T + 1, 2B, ...], episode ends included, and a non-zero core state."""
    generator = torch.Generator().manual_seed(2)
    columns = WORLD_SIZE * B
    batch = {
        "obs": torch.randint(0, 256, (T + 1, columns, *OBSERVATION_SHAPE), dtype=torch.uint8, generator=generator),
        "done": torch.rand(T + 1, columns, generator=generator) < 0.2,
        "reward": torch.randn(T + 1, columns, generator=generator),
        "action": torch.randint(0, NUM_ACTIONS, (T + 1, columns), generator=generator),
        "policy_logits": torch.randn(T + 1, columns, NUM_ACTIONS, generator=generator),
    }
    # Some of the episode ends are time limits, each with the value of the observation it stopped at.
    batch["truncated"] = batch["done"] & (torch.rand(T + 1, columns, generator=generator) < 0.5)
    batch["truncation_value"] = torch.where(batch["truncated"], torch.randn(T + 1, columns, generator=generator), 0.0)
    if nan_in_column is not None:
        batch["reward"][2, nan_in_column] = float("nan")
    core_state: tuple = ()
    if config.use_lstm:
        core_state = tuple(0.5 * torch.randn(1, columns, config.hidden_size, generator=generator) for _ in range(2))
    return batch, core_state


def _half(batch: dict[str, torch.Tensor], core_state: tuple, rank: int) -> tuple[dict[str, torch.Tensor], tuple]:
    columns = slice(rank * B, (rank + 1) * B)
    return {k: v[:, columns] for k, v in batch.items()}, tuple(s[:, columns] for s in core_state)


def _update(config: Config, batch: dict[str, torch.Tensor], core_state: tuple, world_size: int,
            reducer: GradientReducer | None, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    model = _model(config).to(device)
    optimizer, scheduler = learner.make_optimizer(model, config, world_size)
    batch = {k: v.to(device) for k, v in batch.items()}
    core_state = tuple(s.to(device) for s in core_state)
    stats = learner.update(model, optimizer, scheduler, batch, core_state, config, reducer=reducer)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, stats


def _rank_process(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks: every case with this rank's half of the batch, with the all-reduce and without."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=60))
    results: dict[str, Any] = {"votes": _votes(rank)}
    for name, whole_config in CASES.items():
        config = dataclasses.replace(whole_config, batch_size=B)
        half = _half(*_whole_batch(config), rank)
        reducer = GradientReducer(WORLD_SIZE, summed_loss=config.policy_loss == "impala")
        results[name] = _update(config, *half, WORLD_SIZE, reducer)
        results[f"{name}-no-all-reduce"] = _update(config, *half, WORLD_SIZE, None)
    config = dataclasses.replace(CASES["shallow-impala"], batch_size=B)
    nan_half = _half(*_whole_batch(config, nan_in_column=WORLD_SIZE * B - 1), rank)  # in rank 1's half only
    results["nan-on-rank-1"] = _update(config, *nan_half, WORLD_SIZE,
                                       GradientReducer(WORLD_SIZE, summed_loss=True))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _votes(rank: int) -> dict[str, Any]:
    """Three updates' votes: both go (rank 1 with two games); rank 1 stops; rank 0 votes once more alone."""
    coordinator = Coordinator(Ranks(rank, WORLD_SIZE, rank, WORLD_SIZE, torch.device("cpu"), dist.group.WORLD),
                              summed_loss=True)
    # Rank 1's actors died more often: more lives, more env seeds; rank 0 has more lives of fewer envs.
    coordinator.lives = ActorLives(seed=rank, session=0, lives=(4, 3)[rank], env_seeds_used=(8, 12)[rank])
    games_before = coordinator.games([(1.5, 10), (2.5, 20)] if rank == 1 else [(-1.0, 7)])
    first = coordinator.vote(stop=False, steps=10 + rank)
    run_wide = coordinator.run_wide_lives({"step": 5, "actor_lives": 4, "env_seeds_used": 8})
    games_after = coordinator.games([(float(i), i) for i in range(MAX_GAMES_PER_VOTE + 3)] if rank == 1 else [])
    second = coordinator.vote(stop=rank == 1, steps=10)
    games_many = coordinator.games([])
    third = coordinator.vote(stop=False, steps=10) if rank == 0 else None  # a collective here would hang
    after_stop = coordinator.games([(3.5, 30)])  # the drain after the stop: no vote carries them
    return {"games_before": games_before, "first": first, "games_after": games_after, "second": second,
            "games_many": games_many, "third": third, "stopped_by": coordinator.stopped_by, "run_wide": run_wide,
            "after_stop": after_stop}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of two gloo ranks ended with, one process per rank (started once for every test here)."""
    out_dir = tmp_path_factory.mktemp("ranks")
    init_file = out_dir / "init"
    mp.spawn(_rank_process, args=(str(init_file), str(out_dir)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One learner, one update with the whole batch of 2 x B unrolls."""
    config = CASES[name]
    torch.set_num_threads(1)
    parameters, stats = _update(config, *_whole_batch(config), 1, None)
    assert stats["skipped"] == 0
    return parameters


def _compiled_rank_process(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks updating with --compile's loss (PPO, advantages normalised over both ranks); rank 1
    is lost after the first update, and rank 0 records what its second one raises."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=60))
    config = Config(env="CartPole-v1", unroll_length=T, batch_size=B, policy_loss="ppo", epochs=1, minibatches=1,
                    model="mlp", compile=True, disable_cuda=True)
    torch.manual_seed(1)
    model = Net((4,), 2, "mlp", False, config.hidden_size)
    optimizer, scheduler = learner.make_optimizer(model, config, WORLD_SIZE)
    loss_fn = learner.loss_function(config, torch.device("cpu"), WORLD_SIZE)
    reducer = GradientReducer(WORLD_SIZE, summed_loss=False)
    generator = torch.Generator().manual_seed(rank)
    batch = {"obs": torch.randn(T + 1, B, 4, generator=generator), "done": torch.zeros(T + 1, B, dtype=torch.bool),
             "reward": torch.randn(T + 1, B, generator=generator), "action": torch.randint(0, 2, (T + 1, B)),
             "policy_logits": torch.randn(T + 1, B, 2, generator=generator),
             "truncated": torch.zeros(T + 1, B, dtype=torch.bool), "truncation_value": torch.zeros(T + 1, B)}
    learner.update(model, optimizer, scheduler, batch, (), config, reducer=reducer, loss_fn=loss_fn)
    if rank == 1:
        os._exit(0)  # lost between two updates, as a killed rank is
    time.sleep(1.0)
    try:
        learner.update(model, optimizer, scheduler, batch, (), config, reducer=reducer, loss_fn=loss_fn)
        raised = "nothing"
    except Exception as exc:  # noqa: BLE001 (what it raises is the result)
        raised = f"{type(exc).__name__}: {exc}"
    (Path(out_dir) / "raised").write_text(f"{raised}\nfailed={reducer.failed}")
    os._exit(0)  # the group is broken: no orderly teardown


@pytest.mark.usefixtures("cpp_compiler")
def test_a_rank_lost_under_compile_is_the_one_line_of_a_lost_rank(tmp_path: Path) -> None:
    """--compile traces the loss; the advantages' all-reduce inside it must still end in the one line (it was a
    raw gloo error with a traceback, the reducer not marked failed)."""
    mp.spawn(_compiled_rank_process, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    raised, failed = (tmp_path / "raised").read_text().splitlines()
    assert raised.startswith("TrainingError: another learner process stopped answering (advantage normalisation: ")
    assert failed == "failed=True"


@pytest.mark.parametrize(("variables", "flags", "message"), [
    ({"TORCHELASTIC_RUN_ID": "none"}, {}, "under torchrun without --standalone or --rdzv-id, pass --xpid NAME"),
    ({"TORCHELASTIC_RUN_ID": "abc"}, {"ray": "local"}, "--ray local starts a private Ray in every learner process"),
])
def test_join_refuses_before_joining(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str],
                                     flags: dict[str, str], message: str) -> None:
    """Refused before any rendezvous (none is running here: joining would wait for it)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", **variables}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=re.escape(message)):
        distributed.join(Config(env="CartPole-v1", **flags))


def _agreed(configs: list[Config], xpid: str = "run", gpus: tuple[str | None, ...] = (None, None)) -> list[Any]:
    """What `_agree` returns (or raises) on each rank of a job, every rank in a thread of its own, one store."""
    import threading

    store, outcomes = dist.HashStore(), [None] * len(configs)

    def rank(index: int) -> None:
        try:
            outcomes[index] = distributed._agree(store, index, len(configs), configs[index], xpid, gpus[index])
        except UserError as exc:
            outcomes[index] = str(exc)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def test_ranks_started_with_flags_that_shape_the_update_differently_are_refused_on_every_rank() -> None:
    """Replicas of different learning rates drift apart silently; of different optimisers, one fails mid-run."""
    base = Config(env="CartPole-v1", xpid="run")
    line = ("the learner processes were started with different flags: --optimizer 'adam' on rank 0, 'rmsprop' on "
            "rank 1; --learning_rate 0.00025 on rank 0, 0.01 on rank 1; give every rank the same command line")
    assert _agreed([base, dataclasses.replace(base, learning_rate=0.01, optimizer="rmsprop")]) == [line, line]
    # A rank's own machine: its actors, its devices, its patience; and what rank 0 alone does
    own = dataclasses.replace(base, num_actors=3, envs_per_actor=2, inference="central", disable_cuda=True,
                              actor_timeout_s=60.0, eval_interval_s=30.0, savedir="/elsewhere")
    assert _agreed([base, own]) == ["run", "run"]
    assert distributed.RANK_OWN_FLAGS <= {field.name for field in dataclasses.fields(Config)}


def test_xpid_latest_is_read_on_rank_0_alone(tmp_path: Path) -> None:
    """The other machines need no copy of the run directory: their rank takes the run rank 0 reads in `latest`."""
    (tmp_path / "latest").write_text("cartpole-7\n")
    (tmp_path / "cartpole-7").mkdir()
    on_rank_0 = Config(env="CartPole-v1", xpid="latest", savedir=str(tmp_path))
    elsewhere = dataclasses.replace(on_rank_0, savedir=str(tmp_path / "not-here"))
    assert _agreed([on_rank_0, elsewhere], xpid="latest") == ["cartpole-7", "cartpole-7"]
    refused = _agreed([elsewhere, on_rank_0], xpid="latest")
    assert refused[0].startswith(f"--xpid latest: no run in {tmp_path / 'not-here'} yet")
    assert refused[1] == f"rank 0 cannot name the run: {refused[0]}"


def test_ranks_on_a_gpu_and_on_the_cpu_or_sharing_a_gpu_are_refused() -> None:
    configs = [Config(env="CartPole-v1", xpid="run")] * 3
    mixed = _agreed(configs, gpus=("GPU-a", None, "GPU-b"))
    assert mixed == [("rank(s) 0, 2 learn on a GPU and the others on the CPU: give every rank a GPU, or pass "
                      "--disable_cuda to every rank")] * 3
    sharing = _agreed(configs, gpus=("GPU-a", "GPU-b", "GPU-a"))
    assert all(line.startswith("ranks 0, 2 would share a GPU, which NCCL refuses") for line in sharing)
    assert _agreed(configs, gpus=("GPU-a", "GPU-b", "GPU-c")) == ["run"] * 3


def test_a_rank_that_cannot_join_the_others_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLOO_SOCKET_IFNAME naming no interface, an address that cannot be bound: torch.distributed's RuntimeError
    from deep in the rendezvous or the process group becomes the run's one line (it was a traceback)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "abc",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)

    def unreachable(*args: object) -> None:
        raise dist.DistNetworkError("[enforce fail at device.cc:84] ifa != nullptr. Unable to find address for: bogus0")

    monkeypatch.setattr(distributed, "_attempt_store", unreachable)
    with pytest.raises(TrainingError, match=re.escape(
            "the learner processes could not join each other ([enforce fail at device.cc:84] ifa != nullptr. Unable "
            "to find address for: bogus0); where a machine's name does not resolve")):
        distributed.join(Config(env="CartPole-v1", disable_cuda=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_job_of_one_rank_joins_through_torchruns_store_with_its_run_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str) -> None:
    """The whole of `join` as torchrun starts it: the store, the flags agreed (`--xpid latest` read), the group."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "latest").write_text("cartpole-3\n")
    (tmp_path / "cartpole-3").mkdir()
    config, coordinator = distributed.join(Config(env="CartPole-v1", xpid="latest", savedir=str(tmp_path), seed=5,
                                                  disable_cuda=device == "cpu"))
    try:
        assert coordinator is not None and coordinator.ranks.device.type == device
        assert (config.xpid, config.seed) == ("cartpole-3", 5)  # rank 0 keeps the run's seed
        assert dist.get_backend() == ("nccl" if device == "cuda" else "gloo")
    finally:
        distributed.leave(coordinator)


def test_join_names_the_run_after_the_rendezvous_id_which_resume_needs_no_xpid_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    for run_id in ("none", ""):  # torchrun without --rdzv-id or --standalone
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        with pytest.raises(UserError, match="--resume needs --xpid NAME"):
            parse_config(["--env", "CartPole-v1", "--resume"])
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a/b c")
    assert distributed.default_xpid(Config(env="ALE/Pong-v5")) == "ALE_Pong-v5-a_b_c"
    assert parse_config(["--env", "CartPole-v1", "--resume"]).resume  # the run of that id: ENV-ID
    monkeypatch.delenv("LOCAL_RANK")  # a variable left in a shell names nothing outside torchrun
    with pytest.raises(UserError, match="--resume needs --xpid NAME"):
        parse_config(["--env", "CartPole-v1", "--resume"])


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_with_half_a_batch_each_update_as_one_learner_with_the_whole_batch(
        ranks: list[dict[str, Any]], name: str) -> None:
    expected = _reference(name)
    initial = _initial(CASES[name])
    for rank in range(WORLD_SIZE):
        parameters, stats = ranks[rank][name]
        assert stats["skipped"] == 0
        for key, value in parameters.items():
            assert not torch.equal(value, initial[key]) or key.endswith("num_batches_tracked"), key  # it moved
            # Float32 round-off: the sums over the batch are added in another order.
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=lambda m, rank=rank, key=key: f"{name} rank {rank} {key}: {m}")
    for key in expected:  # the replicas are the same, bit for bit
        assert torch.equal(ranks[0][name][0][key], ranks[1][name][0][key]), key


@pytest.mark.parametrize("name", list(CASES))
def test_without_the_all_reduce_the_ranks_drift_from_the_whole_batch_update(
        ranks: list[dict[str, Any]], name: str) -> None:
    """The test above can fail: each rank's own half-batch gradient moves the weights elsewhere."""
    expected = _reference(name)
    for rank in range(WORLD_SIZE):
        parameters, _ = ranks[rank][f"{name}-no-all-reduce"]
        worst = max(float((parameters[key] - expected[key]).abs().max()) for key in expected)
        assert worst > 1e-4, (name, rank, worst)


def test_a_non_finite_loss_on_one_rank_makes_every_rank_skip_the_step(ranks: list[dict[str, Any]]) -> None:
    initial = _initial(CASES["shallow-impala"])
    for rank in range(WORLD_SIZE):
        parameters, stats = ranks[rank]["nan-on-rank-1"]
        assert stats["skipped"] == 1, rank
        assert all(torch.equal(parameters[key], initial[key]) for key in initial), rank


def test_votes_sum_the_steps_of_every_rank_agree_to_stop_and_bring_every_game_to_rank_0(
        ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["votes"], ranks[1]["votes"]
    assert zero["first"] == one["first"] == 21  # 10 + 11 agent steps
    assert zero["games_before"] == one["games_before"] == ([], 0)  # games travel with the next vote
    assert zero["games_after"] == ([(-1.0, 7), (1.5, 10), (2.5, 20)], 0)  # in rank order
    assert one["games_after"] == one["games_many"] == ([], 0)  # only rank 0 logs games
    # More games in one update than a vote lists: the newest one by one, the others counted, none left waiting.
    assert zero["games_many"] == ([(float(i), i) for i in range(3, MAX_GAMES_PER_VOTE + 3)], 3)
    assert zero["second"] == one["second"] == 0  # rank 1 stopped: every rank stops at this update
    assert zero["third"] == 0  # after a stop, no collective: rank 0 alone did not wait for rank 1
    assert zero["stopped_by"] == 1 and one["stopped_by"] is None  # rank 1 stopped by its own choice
    # Games finished after the stop: rank 0 logs its own, as a plain run does; another rank's have no way there.
    assert zero["after_stop"] == ([(3.5, 30)], 0) and one["after_stop"] == ([], 0)
    # Rank 0's checkpoint keeps the most lives and env seeds any rank used: every rank resumes from it, and
    # rank 1 would otherwise hand out again its seeds 8 to 11 past its own rank seed.
    assert zero["run_wide"] == {"step": 5, "actor_lives": 4, "env_seeds_used": 12}


# ---------------------------------------------------------------------------------------- on a GPU

def _cuda_rank_process(rank: int, init_file: str, out_dir: str) -> None:
    """One of two gloo ranks whose tensors live on the GPU (NCCL refuses two ranks on one GPU)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=60))
    config = dataclasses.replace(CASES["lstm-impala"], batch_size=B)
    half = _half(*_whole_batch(config), rank)
    result = _update(config, *half, WORLD_SIZE, GradientReducer(WORLD_SIZE, summed_loss=True), device="cuda")
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gloo_ranks_with_cuda_tensors_update_as_one_learner_with_the_whole_batch(tmp_path: Path) -> None:
    mp.spawn(_cuda_rank_process, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    config = CASES["lstm-impala"]
    expected, _ = _update(config, *_whole_batch(config), 1, None, device="cuda")
    for rank in range(WORLD_SIZE):
        parameters, stats = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert stats["skipped"] == 0
        for key, value in parameters.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5)  # TF32 and cuDNN's own sums


def test_a_job_of_one_rank_gives_its_gradient_steps_no_reducer_and_one_of_two_ranks_does() -> None:
    """torchrun with one process: nothing to reduce, so its learner takes a plain run's update, which on a GPU is
    one CUDA graph (`learner.uses_cuda_graph`); with two, every gradient step goes through the reducer."""
    one = Coordinator(Ranks(0, 1, 0, 1, torch.device("cpu"), None), summed_loss=False)
    two = Coordinator(Ranks(0, 2, 0, 2, torch.device("cpu"), None), summed_loss=False)
    assert one.step_reducer is None
    assert two.step_reducer is two.reducer and two.reducer.world_size == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_with_one_rank_reduces_on_the_gpu_and_leaves_the_update_alone(tmp_path: Path) -> None:
    """NCCL's all-reduce of one rank is the identity: the update equals a plain one, and votes go through the
    gloo control group beside NCCL as `distributed.join` makes it."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        control = dist.new_group(backend="gloo")
        config = dataclasses.replace(CASES["shallow-ppo"], batch_size=WORLD_SIZE * B)
        batch = _whole_batch(config)
        reduced, _ = _update(config, *batch, 1, GradientReducer(1, summed_loss=False), device="cuda")
        plain, _ = _update(config, *batch, 1, None, device="cuda")
        for key, value in plain.items():
            torch.testing.assert_close(reduced[key], value, rtol=1e-5, atol=1e-6)
        coordinator = Coordinator(Ranks(0, 1, 0, 1, torch.device("cuda", 0), control), summed_loss=False)
        assert coordinator.vote(stop=False, steps=7) == 7
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- torchrun runs


# Each rank has one actor (the machine has two cores for the two ranks and their actors).
SMALL_RANKS = (*SMALL_RUN, "--num_actors", "1", "--disable_cuda")


def _impala_tracebacks(text: str) -> list[str]:
    """Traceback lines through this package's files: a fault of ours, not a line a user can read."""
    ours = (f'File "{REPO_ROOT / "impala"}', f'File "{REPO_ROOT / "run.py"}')  # not a venv inside the repository
    return [line for line in text.splitlines() if line.strip().startswith(ours)]


@needs_ray  # without Ray rank 1 refuses at once, and torchrun may stop rank 0 before it reads the run
def test_a_rank_that_refuses_the_run_in_its_build_leaves_the_run_directory_as_it_was(tmp_path: Path) -> None:
    """Rank 1 refuses (here its Ray cluster cannot be reached, which takes it a while; on another machine, its shared
    memory, say) after rank 0 has read the run: rank 0 writes nothing (it added a start and an error to meta.json,
    and an event file)."""
    first = run_py(*SMALL_RANKS, "--savedir", str(tmp_path), "--xpid", "kept", "--total_steps", "400")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "kept"
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    command = " ".join([sys.executable, "run.py", *SMALL_RANKS, "--savedir", str(tmp_path), "--xpid", "kept",
                        "--total_steps", "800"]) + ' $([ "$RANK" = 1 ] && echo --ray 127.0.0.1:1)'
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode != 0
    assert "run.py: error (rank 1): --ray " in done.stderr, done.stderr
    assert ("run.py: training failed: another learner process ended before the run began, most likely refusing it "
            "(its own line says why): ") in done.stderr, done.stderr
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before


def test_sigterm_to_torchrun_stops_every_rank_in_order_with_a_checkpoint(tmp_path: Path) -> None:
    run = Torchrun(tmp_path, "term", flags=SMALL_RANKS)
    try:
        run.wait_for_steps(400, timeout=240)
        run.signal(signal.SIGTERM)  # torchrun forwards it to every rank
        run.wait(timeout=120)
        text = run.text()
        assert "SIGTERM: stopping" in text
        saved = [int(s) for s in re.findall(r"Saved checkpoint at step (\d+)", text)]
        assert saved and checkpoint_step(run.run_dir) == saved[-1] >= 400
        assert re.search(r"Run ended \(terminated\) at step \d+", text)
        assert _impala_tracebacks(text) == [], text
        assert not re.search(r"rank 1\] .*(failed|stopped answering|Traceback)", text), text  # rank 1 stopped cleanly
        assert wait_until_gone(run.pgid) == []  # every rank, actor and fork server
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "term", "term.console"]  # one run
    finally:
        run.close()
    _assert_run_says_two_ranks_trained(run.run_dir, text)


def _assert_run_says_two_ranks_trained(run_dir: Path, text: str) -> None:
    """In the first lines of the log, in meta.json and in the flags TensorBoard shows."""
    assert re.search(r"Run .*\n.*\] 2 learner ranks \(torchrun, gloo\)", text), text[:2000]
    assert json.loads((run_dir / "meta.json").read_text())["world_size"] == 2
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    assert "| world_size | `2` |" in events.Tensors("flags/text_summary")[0].tensor_proto.string_val[0].decode()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["world_size"].number_value == 2


def test_kill_9_of_one_rank_ends_the_job_with_one_line_and_the_last_checkpoint_kept(tmp_path: Path) -> None:
    run = Torchrun(tmp_path, "kill", "--checkpoint_interval_s", "1", flags=SMALL_RANKS)
    try:
        run.wait_for(r"Saved checkpoint at step [1-9]", timeout=240)  # one after an update
        os.kill(run.rank_pid(1), signal.SIGKILL)
        start = time.monotonic()
        assert run.wait(timeout=120) != 0
        text = run.text()
        lost = [line for line in text.splitlines() if "another learner process stopped answering" in line]
        # One line each, whole: nothing of the message on the lines after. (Whether the rank left then ends as the
        # fault or as torchrun's SIGTERM, "error" or "terminated", is a race: torchrun sees the death too.)
        assert lost and all(line.endswith("it died or was stopped, see its own output") for line in lost), text
        assert _impala_tracebacks(text) == [], text
        assert checkpoint_step(run.run_dir) > 0  # whole: the last periodic one, or one saved on the way out
        assert wait_until_gone(run.pgid) == []
        print(f"job ended {time.monotonic() - start:.1f} s after the kill; rank 0 said: {lost[0]}")
    finally:
        run.close()


@pytest.mark.slow
def test_torchrun_cartpole_learns_as_one_run_that_test_mode_plays(tmp_path: Path) -> None:
    """The README's CartPole command on two ranks, cut from 300k agent steps to 80k (45-47 s on the idle 2-core
    development machine; the whole command, 2.5 minutes, is in the README). At 80k two seeds ended with a mean
    of the last 100 games of 375 and 420, and test mode played both at 500; random actions get about 22."""
    savedir = tmp_path / "runs"
    run = Torchrun(savedir, "cartpole", total_steps=80_000, flags=README_CARTPOLE_RANKS)
    try:
        assert run.wait(timeout=3600) == 0, run.text()
    finally:
        run.close()
    run_dir = savedir / "cartpole"
    assert sorted(p.name for p in savedir.iterdir()) == ["cartpole", "cartpole.console", "latest"]  # one run
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # one TensorBoard run
    with open(run_dir / "logs.csv", newline="") as f:
        every = list(csv.DictReader(f))
    votes = [float(row["timing/vote_ms"]) for row in every if row.get("timing/vote_ms")]
    assert votes and all(v >= 0 for v in votes)  # the ranks' agreement before each update, timed apart
    rows = [row for row in every if row.get("charts/mean_return_100")]
    best = max(float(row["charts/mean_return_100"]) for row in rows)
    assert int(rows[-1]["step"]) == 80_000
    assert best >= 250, [row["charts/mean_return_100"] for row in rows]
    played = run_py("--mode", "test", "--env", "CartPole-v1", "--savedir", str(savedir), "--xpid", "cartpole",
                    "--test_episodes", "3")
    assert played.returncode == 0, played.stderr
    mean = float(re.search(r"Mean return over 3 episodes: ([\d.]+)", played.stdout).group(1))  # type: ignore[union-attr]
    print(f"best mean_return_100 {best:.1f}, final {rows[-1]['charts/mean_return_100']}, test mode {mean:.1f}")
    assert mean >= 300
