"""Several learner processes (`impala/distributed.py`): two gloo ranks on the CPU, each with half of a batch,
make the update one learner makes with the whole batch; the replicas stay identical; a non-finite loss on
one rank makes both skip the step."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from impala import learner
from impala.config import Config
from impala.distributed import Coordinator, GradientReducer, Ranks
from impala.model import Net

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
            reducer: GradientReducer | None) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    model = _model(config)
    optimizer, scheduler = learner.make_optimizer(model, config, world_size)
    stats = learner.update(model, optimizer, scheduler, batch, core_state, config, reducer=reducer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


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
    games_before = coordinator.games([(1.5, 10), (2.5, 20)] if rank == 1 else [(-1.0, 7)])
    first = coordinator.vote(stop=False, steps=10 + rank)
    games_after = coordinator.games([])
    second = coordinator.vote(stop=rank == 1, steps=10)
    third = coordinator.vote(stop=False, steps=10) if rank == 0 else None  # a collective here would hang
    return {"games_before": games_before, "first": first, "games_after": games_after, "second": second,
            "third": third, "stopped_by": coordinator.stopped_by}


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


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_with_half_a_batch_each_update_as_one_learner_with_the_whole_batch(
        ranks: list[dict[str, Any]], name: str) -> None:
    expected = _reference(name)
    initial = _model(CASES[name]).state_dict()
    for rank in range(WORLD_SIZE):
        parameters, stats = ranks[rank][name]
        assert stats["skipped"] == 0
        for key, value in parameters.items():
            assert not torch.equal(value, initial[key]) or key.endswith("num_batches_tracked"), key  # it moved
            # Float32 round-off: the sums over the batch are added in another order.
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank} {key}")
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
    initial = _model(CASES["shallow-impala"]).state_dict()
    for rank in range(WORLD_SIZE):
        parameters, stats = ranks[rank]["nan-on-rank-1"]
        assert stats["skipped"] == 1, rank
        assert all(torch.equal(parameters[key], initial[key]) for key in initial), rank


def test_votes_sum_the_steps_of_every_rank_agree_to_stop_and_bring_every_game_to_rank_0(
        ranks: list[dict[str, Any]]) -> None:
    zero, one = ranks[0]["votes"], ranks[1]["votes"]
    assert zero["first"] == one["first"] == 21  # 10 + 11 agent steps
    assert zero["games_before"] == one["games_before"] == []  # games travel with the next vote
    assert zero["games_after"] == [(-1.0, 7), (1.5, 10), (2.5, 20)]  # in rank order
    assert one["games_after"] == []  # only rank 0 logs games
    assert zero["second"] == one["second"] == 0  # rank 1 stopped: every rank stops at this update
    assert zero["third"] == 0  # after a stop, no collective: rank 0 alone did not wait for rank 1
    assert zero["stopped_by"] == 1 and one["stopped_by"] is None  # rank 1 stopped by its own choice
