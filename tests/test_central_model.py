"""scripts/central_model.py: its closed loop against what can be worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("central_model", REPO / "scripts" / "central_model.py")
assert spec is not None and spec.loader is not None
central_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(central_model)


def test_an_instant_server_leaves_the_actors_stepping_their_envs_all_the_time():
    # 14 actors x 2 splits x 4 envs, each split's envs stepping 2.8 ms at a time: 40,000 agent steps/s
    rate, per_batch = central_model.simulate(0.0, 0.0, threads=1, write_ms=0.0)
    assert rate == pytest.approx(14 * 2 * 4 / 2.8e-3, rel=1e-3)
    assert per_batch == 1.0  # nobody ever waits for anybody


def test_one_thread_serves_the_actors_in_two_alternating_halves_and_two_threads_in_a_pipeline():
    rate_1, per_batch_1 = central_model.simulate(1.5, 0.21, threads=1)
    assert per_batch_1 == pytest.approx(7.0, abs=0.01)  # half of the 14 actors: the other half asks while a batch runs
    # a half asks again (0.3 ms) while the other half's batch runs, then waits out its own: 4 envs per actor every
    # 2 x (1.5 + 7 x 0.21) ms
    assert rate_1 == pytest.approx(14 * 4 / (2 * (1.5 + 7 * 0.21)) * 1000, rel=0.01)
    rate_2, per_batch_2 = central_model.simulate(1.5, 0.21, threads=2)
    assert per_batch_2 < per_batch_1 and rate_2 > 1.5 * rate_1


@pytest.mark.parametrize("wait_ms", [0.5, 5.0])
def test_a_wait_gathers_both_halves_into_one_batch_and_ends_when_every_actor_has_asked(wait_ms):
    # the half just answered asks again 0.3 ms later, into the batch the other half waits in; with every actor in,
    # the batch starts, however long the wait could have been
    rate, per_batch = central_model.simulate(2.5, 0.05, threads=1, wait_ms=wait_ms)
    assert per_batch == pytest.approx(14.0, abs=0.01)
    # one batch of all 14 every 2.5 + 14 x 0.05 ms, and 0.3 ms to ask again: 4 envs per actor per cycle
    assert rate == pytest.approx(14 * 4 / (2.5 + 14 * 0.05 + 0.3) * 1000, rel=0.02)
