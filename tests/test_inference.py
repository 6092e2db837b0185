"""Central inference: the server answers actors' requests with the model's outputs written into slots."""

from __future__ import annotations

import copy
import csv
import io
import json
import subprocess
import sys
import threading
import time
import types
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch
from process_helpers import IMPALA_RULE

from impala import inference
from impala.actor import RemotePolicy, StopActing
from impala.buffers import BufferSpec, create_buffers
from impala.channels import signal, take_signal
from impala.inference import InferenceServer, InferenceServers
from impala.model import Net

ROOT = Path(__file__).resolve().parents[1]
ENVS = 3
OBS_SHAPE = (4,)


def make_server(num_actors: int, wait_s: float) -> tuple[InferenceServer, dict, torch.Tensor, Net, list]:
    torch.manual_seed(0)
    model = Net(OBS_SHAPE, 2, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(num_actors * ENVS, 4, OBS_SHAPE, torch.float32, 2))
    positions = torch.full((num_actors, ENVS + 1), -1, dtype=torch.int64)
    server = InferenceServer(model, buffers, positions, torch.device("cpu"), amp=False, wait_s=wait_s, seed=0)
    actor_ends = []
    for actor_index in range(num_actors):
        main_end, actor_end = Pipe()
        server.connect(actor_index, main_end)
        actor_ends.append(actor_end)
    return server, buffers, positions, model, actor_ends


def request(buffers: dict, positions: torch.Tensor, actor_index: int, actor_end, t: int) -> torch.Tensor:
    """What an actor does before asking: write its observations at row t, publish where they are, ask."""
    slots = torch.arange(actor_index * ENVS, (actor_index + 1) * ENVS)
    buffers["obs"][slots, t] = torch.randn(ENVS, *OBS_SHAPE)
    buffers["done"][slots, t] = False
    positions[actor_index, :-1] = slots
    positions[actor_index, -1] = t
    signal(actor_end)
    return slots


def test_served_outputs_are_the_models_outputs_for_the_observations_in_the_slots():
    server, buffers, positions, model, ends = make_server(num_actors=2, wait_s=0.0)
    slots_a = request(buffers, positions, 0, ends[0], t=1)
    slots_b = request(buffers, positions, 1, ends[1], t=2)
    served = 0
    while served < 2:
        served += server.serve_once(timeout_s=1.0)
    assert ends[0].poll(1.0) and ends[1].poll(1.0), "each actor gets its answer"
    for slots, t in ((slots_a, 1), (slots_b, 2)):
        with torch.no_grad():
            expected, _ = model(buffers["obs"][slots, t][None], buffers["done"][slots, t][None])
        torch.testing.assert_close(buffers["policy_logits"][slots, t], expected.policy_logits[0])
        torch.testing.assert_close(buffers["baseline"][slots, t], expected.baseline[0])
        assert set(buffers["action"][slots, t].tolist()) <= {0, 1}
    # Rows nobody asked about keep their poison.
    assert torch.isnan(buffers["policy_logits"][slots_a, 0]).all()
    assert (buffers["action"][slots_a, 3] == -1).all()


def test_the_server_acts_with_the_published_weights_not_those_being_changed():
    """A learner changes its weights in place, step by step; the server acts with the snapshot of the last
    publish until the next one, so no forward mixes two versions."""
    server, buffers, positions, model, ends = make_server(num_actors=1, wait_s=0.0)
    published = copy.deepcopy(model)

    def served_logits(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = request(buffers, positions, 0, ends[0], t=t)
        while not server.serve_once(timeout_s=1.0):
            pass
        assert ends[0].poll(1.0) and take_signal(ends[0])
        return buffers["obs"][slots, t][None], buffers["policy_logits"][slots, t]

    with torch.no_grad():
        for param in model.parameters():  # the learner's update, not yet published
            param.add_(0.5)
    obs, logits = served_logits(t=0)
    with torch.no_grad():
        expected, _ = published(obs, torch.zeros(1, ENVS, dtype=torch.bool))
    torch.testing.assert_close(logits, expected.policy_logits[0])
    server.load_weights(model)  # the publish after that update
    obs, logits = served_logits(t=1)
    with torch.no_grad():
        expected, _ = model(obs, torch.zeros(1, ENVS, dtype=torch.bool))
        old, _ = published(obs, torch.zeros(1, ENVS, dtype=torch.bool))
    torch.testing.assert_close(logits, expected.policy_logits[0])
    assert not torch.allclose(logits, old.policy_logits[0])


def test_zero_wait_serves_whoever_is_ready():
    server, buffers, positions, _, ends = make_server(num_actors=3, wait_s=0.0)
    request(buffers, positions, 1, ends[1], t=0)
    assert server.serve_once(timeout_s=1.0) == 1
    assert ends[1].poll(1.0) and not ends[0].poll(0) and not ends[2].poll(0)


def test_a_wait_gathers_late_actors_into_one_batch():
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=5.0)
    request(buffers, positions, 0, ends[0], t=0)
    late = threading.Timer(0.2, request, args=(buffers, positions, 1, ends[1], 0))
    late.start()
    assert server.serve_once(timeout_s=1.0) == 2  # returned once both asked, well before the 5 s wait
    late.join()
    assert server.batches == 1 and server.served == 2


def test_a_wait_ends_once_every_actor_has_asked_for_one_of_its_splits():
    """Two actors of two env splits each (clients 0-3): each has one split asking at a time, so once actor 0's split
    1 and actor 1's split 0 have asked, nobody else can: the batch starts without waiting out the 600 s."""
    torch.manual_seed(0)
    model = Net(OBS_SHAPE, 2, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(4 * ENVS, 4, OBS_SHAPE, torch.float32, 2))
    positions = torch.full((4, ENVS + 1), -1, dtype=torch.int64)
    server = InferenceServer(model, buffers, positions, torch.device("cpu"), amp=False, wait_s=600.0, seed=0, splits=2)
    ends = []
    for client in range(4):
        main_end, actor_end = Pipe()
        server.connect(client, main_end)
        ends.append(actor_end)
    request(buffers, positions, 1, ends[1], t=0)  # actor 0, split 1
    threading.Timer(0.2, request, args=(buffers, positions, 2, ends[2], 0)).start()  # actor 1, split 0
    start = time.monotonic()
    assert server.serve_once(timeout_s=1.0) == 2
    assert time.monotonic() - start < 60.0, "it waited for splits that could not ask"
    assert ends[1].poll(1.0) and ends[2].poll(1.0)


def _three_servers_of_three_actors_with_four_splits(wait_s: float) -> tuple[InferenceServers, dict, torch.Tensor,
                                                                              list]:
    """--inference_threads 3, --env_splits 4, 3 actors: client c = 4a + s goes to server c mod 3, so every server
    has every actor, and actor a's split 0 (client 4a) goes to server a."""
    torch.manual_seed(0)
    model = Net(OBS_SHAPE, 2, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(12 * ENVS, 4, OBS_SHAPE, torch.float32, 2))
    positions = torch.full((12, ENVS + 1), -1, dtype=torch.int64)
    servers = InferenceServers(model, buffers, positions, torch.device("cpu"), amp=False, wait_s=wait_s,
                               seeds=[0, 1, 2], splits=4)
    ends = []
    for client in range(12):
        main_end, actor_end = Pipe()
        servers.connect(client, main_end)
        ends.append(actor_end)
    assert [sorted({c // 4 for c in server.connections}) for server in servers.servers] == [[0, 1, 2]] * 3
    return servers, buffers, positions, ends


def test_a_wait_does_not_wait_for_actors_that_another_server_has_a_request_of():
    """Three actors, each asking for its splits in turn as actor.py's loop does, the servers in threads with a 600 s
    wait. They start by asking for their split 0, each of another server. An actor cannot ask a second server before
    its first answers, so no server waits for the actors that another has: all lap their splits twice. (Each used to
    wait for every actor it serves, so that every server waited out the 600 s at every batch.)"""
    servers, buffers, positions, ends = _three_servers_of_three_actors_with_four_splits(wait_s=600.0)
    answers = [0, 0, 0]
    stop = threading.Event()

    def actor(a: int) -> None:  # asks until the test ends, as an actor does until the run does
        while not stop.is_set():
            client = 4 * a + answers[a] % 4
            request(buffers, positions, client, ends[client], t=0)
            while not ends[client].poll(0.1):
                if stop.is_set():
                    return
            take_signal(ends[client])
            answers[a] += 1

    serving = [threading.Thread(target=server.serve, args=(stop,), daemon=True) for server in servers.servers]
    actors = [threading.Thread(target=actor, args=(a,), daemon=True) for a in range(3)]
    for thread in serving + actors:
        thread.start()
    deadline = time.monotonic() + 60.0
    while min(answers) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for thread in serving + actors:
        thread.join(5.0)
    assert min(answers) >= 8, f"servers waited for actors that could not ask them: {answers} answers"


def test_a_server_still_waits_for_the_actors_that_ask_nobody():
    """The same three servers, a 5 s wait: actor 0 asks server 0 while actors 1 and 2 ask nobody (stepping their
    envs). Server 0 waits for them, and serves all three in one batch once they have asked it too."""
    servers, buffers, positions, ends = _three_servers_of_three_actors_with_four_splits(wait_s=5.0)
    request(buffers, positions, 0, ends[0], t=0)  # actor 0, split 0: server 0
    served: list[int] = []
    first = threading.Thread(target=lambda: served.append(servers.servers[0].serve_once(timeout_s=1.0)), daemon=True)
    first.start()
    time.sleep(0.3)
    assert first.is_alive(), "it did not wait for the actors asking nobody"
    request(buffers, positions, 6, ends[6], t=0)  # actor 1, split 2: server 0
    request(buffers, positions, 9, ends[9], t=0)  # actor 2, split 1: server 0
    first.join(4.0)
    assert served == [3], "it did not serve the three together before its 5 s were out"
    assert all(ends[client].poll(1.0) and take_signal(ends[client]) for client in (0, 6, 9))


def test_a_stopped_run_ends_the_wait_for_more_actors_and_answers_who_asked():
    """--inference_wait_ms may be a minute: a run that stops meanwhile does not wait for its inference thread that
    long. The thread answers the actor that asked and ends."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=600.0)
    request(buffers, positions, 0, ends[0], t=0)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not ends[0].poll(0)  # waiting for actor 1
    stop.set()
    thread.join(5.0)
    assert not thread.is_alive(), "it waited on for actor 1 after the stop"
    assert ends[0].poll(1.0) and take_signal(ends[0]) and server.served == 1


def test_a_wait_ends_once_the_actors_it_waits_for_wait_for_free_slots():
    """An actor waiting for the learner to free slots asks nobody until it does: a batch does not wait out
    --inference_wait_ms for it (once, that was every batch: with 3 threads of 4 splits and 1,000 ms, 34 agent steps/s
    in place of 2,000). Once it has its slots, the wait is for it again."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=600.0)
    stop = threading.Event()
    actor_1 = RemotePolicy(ends[1], positions[1], stop)
    request(buffers, positions, 0, ends[0], t=0)
    threading.Timer(0.3, actor_1.waiting_for_slots, args=(True,)).start()
    start = time.monotonic()
    assert server.serve_once(timeout_s=1.0) == 1
    assert 0.25 < time.monotonic() - start < 60.0, "it did not wait for actor 1 until it waited for slots"
    assert ends[0].poll(1.0) and take_signal(ends[0])
    actor_1.waiting_for_slots(False)
    request(buffers, positions, 0, ends[0], t=1)
    served: list[int] = []
    thread = threading.Thread(target=lambda: served.append(server.serve_once(timeout_s=1.0)), daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "it did not wait for actor 1 once it had its slots"
    request(buffers, positions, 1, ends[1], t=0)
    thread.join(30.0)
    assert served == [2]


def test_the_wait_for_a_fuller_batch_is_not_work_that_the_hung_thread_watch_counts():
    """`serving_since` is what the watch for hung threads reads: a wait for an actor that does not ask (one waiting
    for free slots) is not a hung batch, however long --inference_wait_ms is; the batch's own work is."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=1.0)
    request(buffers, positions, 0, ends[0], t=0)  # actor 1 never asks
    seen: list[float | None] = []
    acted = server._act

    def act(pending: list[int]) -> tuple[float, float]:
        seen.append(server.serving_since)
        return acted(pending)

    server._act = act  # type: ignore[method-assign]
    watched: list[float | None] = []

    def look() -> None:
        for _ in range(7):
            watched.append(server.serving_since)
            time.sleep(0.1)

    watch = threading.Thread(target=look)
    start = time.monotonic()
    watch.start()
    assert server.serve_once(timeout_s=1.0) == 1
    watch.join()
    assert time.monotonic() - start >= 1.0  # it waited the whole second for actor 1
    assert watched[:7] == [None] * 7, watched  # through the wait's first 0.7 s
    assert seen[0] is not None and seen[0] - start >= 0.99  # the batch's clock starts after the wait, at its work
    assert server.serving_since is None  # and stops with it


def test_the_servers_stats_are_those_of_the_batches_since_they_were_last_taken():
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=0.3)
    request(buffers, positions, 0, ends[0], t=0)
    assert server.serve_once(timeout_s=1.0) == 1  # waited 0.3 s for the other actor, in vain: that was serving
    request(buffers, positions, 0, ends[0], t=1)
    request(buffers, positions, 1, ends[1], t=1)
    assert server.serve_once(timeout_s=1.0) == 2  # both there: no wait
    time.sleep(0.2)  # the thread idle
    stats = server.take_stats()
    assert stats["stats/inference_actors_per_batch"] == 1.5
    assert stats["timing/inference_batch_ms"] >= 150  # (0.3 s + two forwards) / 2
    # the forwards and the slots' part are inside the batches, and the 0.3 s wait in neither
    assert 0 < stats["timing/inference_forward_ms"] and 0 < stats["timing/inference_slots_ms"]
    assert stats["timing/inference_forward_ms"] + stats["timing/inference_slots_ms"] < stats["timing/inference_batch_ms"]
    assert 0 < stats["stats/inference_busy_share"] < 1  # the 0.2 s idle and the set-up are not busy
    assert server.take_stats() == {}  # nothing served since
    request(buffers, positions, 1, ends[1], t=2)
    server.serve_once(timeout_s=1.0)
    assert server.take_stats()["stats/inference_actors_per_batch"] == 1.0


def test_several_servers_each_answer_their_share_of_the_clients_with_every_publish():
    """--inference_threads 2 over 3 clients: server 0 answers clients 0 and 2, server 1 client 1, each in its own
    thread, each acting with the published weights; their stats are those of all batches."""
    torch.manual_seed(0)
    model = Net(OBS_SHAPE, 2, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(3 * ENVS, 4, OBS_SHAPE, torch.float32, 2))
    positions = torch.full((3, ENVS + 1), -1, dtype=torch.int64)
    servers = InferenceServers(model, buffers, positions, torch.device("cpu"), amp=False, wait_s=0.0, seeds=[0, 1])
    ends = []
    for client in range(3):
        main_end, actor_end = Pipe()
        servers.connect(client, main_end)
        ends.append(actor_end)
    assert [sorted(server.connections) for server in servers.servers] == [[0, 2], [1]]
    assert [server.max_clients for server in servers.servers] == [2, 1]
    stop = threading.Event()
    threads = [threading.Thread(target=server.serve, args=(stop,), daemon=True) for server in servers.servers]
    for thread in threads:
        thread.start()
    try:
        for t, weights in ((0, model), (1, copy.deepcopy(model))):
            if t == 1:
                with torch.no_grad():
                    for param in weights.parameters():
                        param.add_(0.5)
                servers.load_weights(weights)  # every server's next batch acts with it
            asked = [request(buffers, positions, client, ends[client], t=t) for client in range(3)]
            for client in range(3):
                assert ends[client].poll(5.0) and take_signal(ends[client]), f"client {client} answered"
            for slots in asked:
                with torch.no_grad():
                    expected, _ = weights(buffers["obs"][slots, t][None], buffers["done"][slots, t][None])
                torch.testing.assert_close(buffers["policy_logits"][slots, t], expected.policy_logits[0])
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    assert [server.served for server in servers.servers] == [4, 2]
    stats = servers.take_stats()
    batches = sum(server.batches for server in servers.servers)
    assert stats["stats/inference_actors_per_batch"] == pytest.approx(6 / batches)
    assert 0 < stats["stats/inference_busy_share"] < 1


def test_remote_policy_returns_the_actions_the_server_wrote():
    server, buffers, positions, _, ends = make_server(num_actors=1, wait_s=0.0)
    stop = threading.Event()
    thread = threading.Thread(target=server.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        policy = RemotePolicy(ends[0], positions[0], stop)
        index = torch.arange(ENVS)
        buffers["obs"][index, 2] = torch.randn(ENVS, *OBS_SHAPE)
        buffers["done"][index, 2] = False
        action = policy(buffers, index, 2, {})
        assert torch.equal(action, buffers["action"][index, 2])
        assert set(action.tolist()) <= {0, 1}
    finally:
        stop.set()
        thread.join(5)


def test_a_signal_is_read_once_and_a_closed_end_reads_as_no_signal():
    main_end, actor_end = Pipe()
    signal(actor_end)
    assert main_end.poll(1.0) and take_signal(main_end)
    assert not main_end.poll(0), "one read took the whole signal"
    signal(main_end)
    assert actor_end.poll(1.0) and take_signal(actor_end)
    actor_end.close()
    assert main_end.poll(1.0) and not take_signal(main_end)


def test_remote_policy_stops_when_asked_and_fails_when_the_servers_end_is_closed():
    server, buffers, positions, _, ends = make_server(num_actors=1, wait_s=0.0)  # kept open, never serving
    index = torch.arange(ENVS)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(StopActing):  # nobody answers: it waits until the run stops
        RemotePolicy(ends[0], positions[0], stop)(buffers, index, 0, {})
    assert server.connections[0].poll(0), "it had asked"
    main_end, actor_end = Pipe()
    main_end.close()  # the main process is gone
    with pytest.raises((EOFError, OSError)):
        RemotePolicy(actor_end, positions[0], threading.Event())(buffers, index, 0, {})


def test_training_with_central_inference_learns_cartpole(tmp_path):
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--inference", "central", "--num_actors", "2",
               "--envs_per_actor", "4", "--unroll_length", "5", "--batch_size", "8", "--learning_rate", "0.001", *IMPALA_RULE,
               "--entropy_cost", "0.01", "--total_steps", "40000", "--savedir", str(tmp_path), "--xpid", "central",
               "--log_interval_s", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    meta = json.loads((tmp_path / "central" / "meta.json").read_text())
    assert meta["end_reason"] == "finished" and meta["final_step"] >= 40000
    lines = (tmp_path / "central" / "logs.csv").read_text().splitlines()
    header = lines[0].split(",")
    column = header.index("charts/mean_return_100")
    returns = [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]
    assert returns and returns[-1] > 60, returns  # random play averages about 22
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    served = [row for row in rows if row["stats/inference_actors_per_batch"]]  # intervals with a batch served
    assert len(served) >= len(rows) - 2  # all but those before the actors had started, or after they stopped
    assert all(1 <= float(row["stats/inference_actors_per_batch"]) <= 2 for row in served)  # 2 actors, 1 split each
    assert all(0 < float(row["stats/inference_busy_share"]) <= 1 for row in served)
    assert all(float(row["timing/inference_batch_ms"]) > 0 for row in served)


def test_a_run_with_two_inference_threads_serves_each_actor_from_its_own_thread(tmp_path):
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--inference", "central", "--inference_threads", "2",
               "--num_actors", "2", "--envs_per_actor", "4", "--unroll_length", "5", "--batch_size", "8",
               "--total_steps", "4000", "--savedir", str(tmp_path), "--xpid", "two", "--log_interval_s", "0.5"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    meta = json.loads((tmp_path / "two" / "meta.json").read_text())
    assert meta["end_reason"] == "finished" and meta["final_step"] >= 4000
    assert "Central inference: 2 threads serving 1 + 1 of the 2 env splits" in result.stdout + result.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "two" / "logs.csv").read_text())))
    served = [row for row in rows if row["stats/inference_actors_per_batch"]]
    assert served, rows
    # 2 actors of one split each, one per thread: every batch answers exactly one
    assert all(float(row["stats/inference_actors_per_batch"]) == 1.0 for row in served)


def test_an_actor_with_two_splits_is_served_as_two_clients():
    """Each env split of an actor has its own pipe and positions row; every row it wrote gets the model's
    outputs for that row's observations."""
    import queue

    from impala.actor import ActorChannels, run_actor
    from impala.config import Config

    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=4, env_splits=2, unroll_length=5, seed=1)
    torch.manual_seed(0)
    model = Net(OBS_SHAPE, 2, "mlp", hidden_size=16).eval()
    buffers = create_buffers(BufferSpec(8, 5, OBS_SHAPE, torch.float32, 2))
    positions = torch.full((2, 3), -1, dtype=torch.int64)
    server = InferenceServer(model, buffers, positions, torch.device("cpu"), amp=False, wait_s=0.0, seed=0)
    actor_ends = []
    for client in range(2):
        main_end, actor_end = Pipe()
        server.connect(client, main_end)
        actor_ends.append(actor_end)
    free, full = queue.Queue(), queue.Queue()
    for slot in range(8):
        free.put(slot)
    stop, served = threading.Event(), threading.Event()
    channels = ActorChannels(free, full, queue.Queue(), queue.Queue(), stop, types.SimpleNamespace(value=0),
                             inference_positions=positions)
    thread = threading.Thread(target=server.serve, args=(served,), daemon=True)
    thread.start()
    try:
        run_actor(0, config, buffers, model, channels, max_unrolls=2, inference_connections=actor_ends)
    finally:
        served.set()
        thread.join(5)
    assert not thread.is_alive()
    assert channels.error_queue.empty()
    assert sorted(full.queue) == list(range(8))
    assert server.batches >= 1 and server.served == 2 * 2 * 5  # each split asked once per step
    obs, done = buffers["obs"][:, :5], buffers["done"][:, :5]
    with torch.no_grad():
        expected, _ = model(obs.transpose(0, 1), done.transpose(0, 1))
    torch.testing.assert_close(buffers["policy_logits"][:, :5], expected.policy_logits.transpose(0, 1))
    torch.testing.assert_close(buffers["baseline"][:, :5], expected.baseline.transpose(0, 1))


def test_a_pipe_replaced_while_a_batch_gathers_is_served_afterwards_not_waited_on_closed(monkeypatch):
    """Client 1's request arrives just as the monitor replaces client 0's pipe: the moment `serve_once` still holds
    the replaced pipe in its snapshot of the connections."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=0.3)
    old_main_end, asking = server.connections[0], server.connections[1]
    new_main_end, new_actor_end = Pipe()

    def take_signal_as_client_0_restarts(connection) -> bool:
        if connection is asking and server.connections[0] is old_main_end:
            server.connect(0, new_main_end)
        return take_signal(connection)

    monkeypatch.setattr(inference, "take_signal", take_signal_as_client_0_restarts)
    request(buffers, positions, 1, ends[1], t=0)
    assert server.serve_once(timeout_s=1.0) == 1  # gathers with client 0's replaced pipe still in its snapshot
    assert ends[1].poll(1.0), "the client that asked is answered"
    request(buffers, positions, 0, new_actor_end, t=1)  # the restarted actor asks on its new pipe
    assert server.serve_once(timeout_s=1.0) == 1
    assert new_actor_end.poll(1.0) and set(buffers["action"][:ENVS, 1].tolist()) <= {0, 1}
    assert old_main_end.closed, "the replaced pipe is closed once no snapshot holds it"


def test_a_dead_actors_pipe_is_dropped_not_waited_on_again_and_its_replacement_is_served():
    """The actor end closed (the actor died) makes the server's end always ready to read: the server drops it
    rather than let `wait` return it at once on every call, which spun the serving thread at 100% CPU until a
    replacement connected. The other client goes on being served, and so is the replacement."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=0.3)
    dead_main_end = server.connections[0]
    ends[0].close()
    request(buffers, positions, 1, ends[1], t=0)
    assert server.serve_once(timeout_s=1.0) == 1  # the live client, not waited on for the dead one's 0.3 s
    assert ends[1].poll(1.0)
    assert list(server.connections) == [1] and dead_main_end.closed
    assert server.serve_once(timeout_s=0.0) == 0  # nothing is ready: the dead pipe is no longer waited on
    new_main_end, new_actor_end = Pipe()
    server.connect(0, new_main_end)  # what the monitor does when it restarts the actor
    request(buffers, positions, 0, new_actor_end, t=1)
    assert server.serve_once(timeout_s=1.0) == 1
    assert new_actor_end.poll(1.0) and set(buffers["action"][:ENVS, 1].tolist()) <= {0, 1}


def test_a_client_that_asks_then_dies_while_a_batch_gathers_is_left_out_of_it():
    """Its pipe turns readable with the end of the actor: the server drops it and serves the others, or nobody."""
    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=5.0)
    request(buffers, positions, 0, ends[0], t=0)

    def die_then_the_other_asks() -> None:
        ends[0].close()
        request(buffers, positions, 1, ends[1], t=0)

    other = threading.Timer(0.2, die_then_the_other_asks)
    other.start()
    start = time.monotonic()
    assert server.serve_once(timeout_s=1.0) == 1  # client 1 alone, once it asked: not the 5 s wait
    assert time.monotonic() - start < 4.0, "it waited on for the dead actor"
    other.join()
    assert ends[1].poll(1.0) and list(server.connections) == [1]
    assert server.batches == 1 and server.served == 1

    server, buffers, positions, _, ends = make_server(num_actors=2, wait_s=3.0)  # the close comes well inside it
    request(buffers, positions, 0, ends[0], t=0)
    threading.Timer(0.1, ends[0].close).start()
    assert server.serve_once(timeout_s=1.0) == 0  # the only client that asked died: no batch
    assert list(server.connections) == [1] and server.batches == 0

    # An actor that had not asked dies while the others wait: they are served then, not after the 60 s (kill -9 of
    # an actor once stalled every actor for the whole --inference_wait_ms).
    server, buffers, positions, _, ends = make_server(num_actors=3, wait_s=60.0)
    request(buffers, positions, 0, ends[0], t=0)
    request(buffers, positions, 1, ends[1], t=0)
    threading.Timer(0.2, ends[2].close).start()
    start = time.monotonic()
    assert server.serve_once(timeout_s=1.0) == 2
    assert time.monotonic() - start < 30.0, "it waited for the dead actor"
    assert sorted(server.connections) == [0, 1]
