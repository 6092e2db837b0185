"""The CUDA paths: a learner update on the GPU (pinned staging, bf16 autocast) and a short run with the
learner and central inference on the GPU. Skipped where no CUDA device is present; `pytest -m gpu`
selects them on a GPU machine."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from process_helpers import IMPALA_RULE

from impala import learner, vtrace
from impala.buffers import BufferSpec, create_buffers, pin_observations, unpin_observations
from impala.config import Config
from impala.model import FlatWeights, Net, sample_actions, use_amp
from impala.plotting import CSV_RETURN_COLUMN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]
GPU_RUN_STEPS = 100_000  # CartPole with small unrolls is past a mean return of 150 by then


def _waits_for_the_gpu(work: Callable[[], object]) -> list[str]:
    """What `work` did that made the host wait for the GPU (torch.cuda.set_sync_debug_mode's warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def test_a_gpu_update_from_pinned_staging_moves_the_weights_and_reports_finite_stats():
    config = Config(unroll_length=20, batch_size=4)
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6).to(device)
    optimizer, scheduler = learner.make_optimizer(model, config)
    buffers = create_buffers(BufferSpec(8, config.unroll_length, (4, 84, 84), torch.uint8, 6))
    buffers["obs"].random_(0, 255)
    buffers["done"].zero_()
    buffers["reward"].uniform_(-1, 1)
    buffers["truncated"].zero_()
    buffers["truncation_value"].zero_()
    buffers["action"].random_(0, 6)
    buffers["policy_logits"].normal_()
    staging = learner.BatchStaging(buffers, config.batch_size, pin=True)
    assert all(t.is_pinned() for t in staging.tensors.values())
    staging.fill([0, 2, 4, 6])
    batch, core_state = staging.to(device)
    assert batch["obs"].device.type == "cuda" and batch["obs"].shape == (21, 4, 4, 84, 84)
    before = [p.detach().clone() for p in model.parameters()]
    stats = learner.update(model, optimizer, scheduler, batch, core_state, config, amp=use_amp(None, device, "shallow"))
    assert stats["skipped"] == 0
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_staging_is_refilled_only_after_the_gpu_has_read_it():
    """An asynchronous copy from pinned staging is still reading it when `to` returns; the next `fill` must wait
    for it, or the batch on the GPU would get rows of the next one."""
    config = Config(unroll_length=20, batch_size=4)
    buffers = create_buffers(BufferSpec(8, config.unroll_length, (4, 84, 84), torch.uint8, 6))
    for slot in range(8):
        buffers["obs"][slot] = slot
    staging = learner.BatchStaging(buffers, config.batch_size, pin=True)
    staging.fill([0, 1, 2, 3])
    torch.cuda._sleep(200_000_000)  # keep the stream busy, so the copy below is still queued when `to` returns
    batch, _ = staging.to(torch.device("cuda"))
    staging.fill([4, 5, 6, 7])
    assert batch["obs"][:, :, 0, 0, 0].cpu().amax(0).tolist() == [0, 1, 2, 3]


def test_page_locked_observations_go_to_the_gpu_unstacked_and_equal_the_stacked_batch():
    """`--pin_slots`: the shared-memory observations are page-locked in place; a batch then copies them slot by slot
    straight to the GPU, and equals the batch that stacking them on the host gives. Unlocked again after."""
    config = Config(unroll_length=20, batch_size=4)
    buffers = create_buffers(BufferSpec(8, config.unroll_length, (4, 84, 84), torch.uint8, 6))
    buffers["obs"].random_(0, 255)
    for key in ("reward", "truncation_value", "policy_logits"):  # NaN-poisoned: torch.equal would never hold
        buffers[key].uniform_(-1, 1)
    stacked = learner.BatchStaging(buffers, config.batch_size, pin=True)
    assert stacked.direct == () and "obs" in stacked.tensors
    slots = [6, 1, 4, 3]
    stacked.fill(slots)
    expected, _ = stacked.to(torch.device("cuda"))
    assert pin_observations(buffers, torch.device("cuda"))
    try:
        assert buffers["obs"].is_pinned() and not buffers["reward"].is_pinned()
        direct = learner.BatchStaging(buffers, config.batch_size, pin=True)
        assert direct.direct == ("obs",) and "obs" not in direct.tensors
        direct.fill(slots)
        batch, _ = direct.to(torch.device("cuda"))
        assert list(batch) == list(expected)
        for key, value in expected.items():
            assert batch[key].device.type == "cuda" and batch[key].is_contiguous()
            assert torch.equal(batch[key], value), key
    finally:
        unpin_observations(buffers, torch.device("cuda"))
    assert not buffers["obs"].is_pinned()


def test_slots_copied_straight_to_the_gpu_may_be_reused_once_to_returns():
    """With observations copied straight from page-locked slots, `to` returns only once the GPU has read them: an
    actor that refills the slots right after cannot change the batch, however busy the GPU was."""
    config = Config(unroll_length=20, batch_size=4)
    buffers = create_buffers(BufferSpec(8, config.unroll_length, (4, 84, 84), torch.uint8, 6))
    for slot in range(8):
        buffers["obs"][slot] = slot
    assert pin_observations(buffers, torch.device("cuda"))
    try:
        staging = learner.BatchStaging(buffers, config.batch_size, pin=True)
        staging.fill([0, 1, 2, 3])
        torch.cuda._sleep(200_000_000)  # keep the stream busy, so the copies queue behind it
        batch, _ = staging.to(torch.device("cuda"))
        buffers["obs"][:4] = 99  # what the actors would write into the slots given back
        assert batch["obs"][:, :, 0, 0, 0].cpu().amax(0).tolist() == [0, 1, 2, 3]
        assert batch["obs"][:, :, 0, 0, 0].cpu().amin(0).tolist() == [0, 1, 2, 3]
    finally:
        unpin_observations(buffers, torch.device("cuda"))


def test_an_eager_update_waits_for_the_gpu_once_per_batch():
    """The default rule (PPO, fused Adam, 2 passes x 8 minibatches) launched step by step (--no-cuda_graph):
    16 gradient steps, one wait for the GPU, for the stats at the end. Non-finite steps are skipped on the
    device."""
    config = Config(unroll_length=20, batch_size=16)
    device = torch.device("cuda")
    model = Net((4, 84, 84), 6).to(device)
    optimizer, scheduler = learner.make_optimizer(model, config)
    batch = _random_gpu_batch(config, device)
    amp = use_amp(None, device, "shallow")
    learner.update(model, optimizer, scheduler, batch, (), config, amp=amp)  # the optimizer's state is made here
    stats: dict[str, float] = {}
    syncs = _waits_for_the_gpu(lambda: stats.update(learner.update(model, optimizer, scheduler, batch, (), config,
                                                                   amp=amp)))
    assert len(syncs) == 1, syncs
    assert stats["skipped"] == 0 and all(math.isfinite(v) for v in stats.values())


def _random_gpu_batch(config: Config, device: torch.device) -> dict[str, torch.Tensor]:
    T, B = config.unroll_length + 1, config.batch_size
    return {"obs": torch.randint(0, 255, (T, B, 4, 84, 84), dtype=torch.uint8, device=device),
            "done": torch.rand(T, B, device=device) < 0.05, "reward": torch.rand(T, B, device=device),
            "truncated": torch.zeros(T, B, dtype=torch.bool, device=device),
            "truncation_value": torch.zeros(T, B, device=device),
            "action": torch.randint(0, 6, (T, B), device=device), "policy_logits": torch.randn(T, B, 6, device=device)}


def test_the_compiled_step_on_the_gpu_replays_cuda_graphs_and_equals_the_eager_step():
    """`--compile` on a GPU: the loss and its backward as CUDA graphs (mode "reduce-overhead"). Three batches of
    the default 2 passes x 8 minibatches move the weights as the eager step does and report its stats, to bf16's
    error; the stats of every step survive the next replay (update() copies them out). One wait per batch.
    Without --cuda_graph, which would capture the whole update instead."""
    config = Config(unroll_length=20, batch_size=16, compile=True, cuda_graph=False)
    device = torch.device("cuda")
    torch.manual_seed(0)
    eager_model = Net((4, 84, 84), 6).to(device)
    compiled_model = Net((4, 84, 84), 6).to(device)
    compiled_model.load_state_dict(eager_model.state_dict())
    start = torch.nn.utils.parameters_to_vector(eager_model.parameters()).detach().clone()
    eager, eager_schedule = learner.make_optimizer(eager_model, config)
    compiled, compiled_schedule = learner.make_optimizer(compiled_model, config)
    loss_fn = learner.loss_function(config, device)
    amp = use_amp(None, device, "shallow")
    for seed in range(3):
        batch = _random_gpu_batch(config, device)
        torch.manual_seed(seed)
        eager_stats = learner.update(eager_model, eager, eager_schedule, batch, (), config, amp=amp)
        torch.manual_seed(seed)
        compiled_stats = learner.update(compiled_model, compiled, compiled_schedule, batch, (), config, amp=amp,
                                        loss_fn=loss_fn)
        if seed == 0:  # from the same weights
            assert compiled_stats == pytest.approx(eager_stats, rel=0.05, abs=0.01)
    # bf16 rounds differently once fused, and Adam turns small gradient differences into whole steps: the two
    # models moved the same way and as far, if not to the same bits.
    moved_eager = torch.nn.utils.parameters_to_vector(eager_model.parameters()) - start
    moved_compiled = torch.nn.utils.parameters_to_vector(compiled_model.parameters()) - start
    assert torch.nn.functional.cosine_similarity(moved_eager, moved_compiled, dim=0) > 0.9
    assert 0.8 < float(moved_compiled.norm() / moved_eager.norm()) < 1.25
    stats: dict[str, float] = {}
    syncs = _waits_for_the_gpu(lambda: stats.update(learner.update(compiled_model, compiled, compiled_schedule, batch,
                                                                   (), config, amp=amp, loss_fn=loss_fn)))
    assert len(syncs) == 1, syncs
    assert stats["skipped"] == 0 and all(math.isfinite(v) for v in stats.values())


def _same_start(config: Config, device: torch.device) -> tuple[Net, Net]:
    torch.manual_seed(0)
    first = Net((4, 84, 84), 6, use_lstm=config.use_lstm).to(device)
    second = Net((4, 84, 84), 6, use_lstm=config.use_lstm).to(device)
    second.load_state_dict(first.state_dict())
    return first, second


def _core_state(model: Net, config: Config, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(s.shape, device=device) for s in model.initial_state(config.batch_size))


@pytest.mark.parametrize(("use_lstm", "minibatch_mode"), [(False, "unrolls"), (True, "unrolls"), (False, "samples")])
def test_a_graphed_update_computes_what_the_eager_update_does(use_lstm: bool, minibatch_mode: str,
                                                               monkeypatch: pytest.MonkeyPatch):
    """`--cuda_graph` (`GraphedUpdate`): three batches of 2 passes x 8 minibatches (of unrolls, or of steps with
    `--minibatch_mode samples`), captured once and replayed, with the linear schedule, float32: the same stats,
    weights and Adam state as `update` from the same random stream, to float error (cuDNN's backward may sum in
    another order)."""
    config = Config(unroll_length=20, batch_size=16, use_lstm=use_lstm, lr_schedule="linear",
                    total_steps=20 * 16 * 4, cuda_graph=True, minibatch_mode=minibatch_mode)
    device = torch.device("cuda")
    eager_model, graphed_model = _same_start(config, device)
    start = torch.nn.utils.parameters_to_vector(eager_model.parameters()).detach().clone()
    eager, eager_schedule = learner.make_optimizer(eager_model, config)
    graphed, graphed_schedule = learner.make_optimizer(graphed_model, config)
    graphed_update = learner.update_function(config, device)
    assert isinstance(graphed_update, learner.GraphedUpdate)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # the same sums in both
    for seed in range(3):
        batch = _random_gpu_batch(config, device)
        core_state = _core_state(eager_model, config, device)
        torch.manual_seed(seed)
        eager_stats = learner.update(eager_model, eager, eager_schedule, batch, core_state, config)
        torch.manual_seed(seed)
        graphed_stats = graphed_update(graphed_model, graphed, graphed_schedule, batch, core_state, config)
        assert graphed_stats == pytest.approx(eager_stats, rel=1e-3, abs=1e-5), seed
        assert graphed_stats["learning_rate"] == eager_stats["learning_rate"] == pytest.approx(2.5e-4 * (1 - seed / 4))
    assert graphed_update._graph is not None and float(graphed.param_groups[0]["lr"]) == pytest.approx(2.5e-4 / 4)
    moved_eager = torch.nn.utils.parameters_to_vector(eager_model.parameters()) - start
    moved_graphed = torch.nn.utils.parameters_to_vector(graphed_model.parameters()) - start
    assert moved_eager.abs().max() > 1e-3  # 48 Adam steps of about the learning rate
    torch.testing.assert_close(moved_graphed, moved_eager, rtol=0, atol=2e-5)
    for param in graphed_model.parameters():
        assert int(graphed.state[param]["step"]) == int(eager.state[next(iter(eager.state))]["step"]) == 48


def test_a_graphed_update_waits_once_skips_a_non_finite_batch_and_recaptures_for_a_new_shape():
    """One wait for the GPU per batch, for the stats; a batch with a NaN changes nothing, on the device; a batch
    of another size is captured anew and learns; `--compile`'s kernels run inside the graph."""
    config = Config(unroll_length=20, batch_size=16, compile=True, cuda_graph=True)
    device = torch.device("cuda")
    model = Net((4, 84, 84), 6).to(device)
    optimizer, scheduler = learner.make_optimizer(model, config)
    update = learner.update_function(config, device)
    loss_fn = learner.loss_function(config, device)
    amp = use_amp(None, device, "shallow")
    batch = _random_gpu_batch(config, device)
    update(model, optimizer, scheduler, batch, (), config, amp, None, loss_fn)  # captures
    stats: dict[str, float] = {}
    syncs = _waits_for_the_gpu(lambda: stats.update(update(model, optimizer, scheduler, batch, (), config, amp,
                                                           None, loss_fn)))
    assert len(syncs) == 1, syncs
    assert stats["skipped"] == 0 and all(math.isfinite(v) for v in stats.values())
    before = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    steps_before = [optimizer.state[p]["step"].clone() for p in model.parameters()]
    bad = dict(batch, reward=batch["reward"].clone())
    bad["reward"][3] = math.nan  # in every minibatch: each step decides for itself
    assert update(model, optimizer, scheduler, bad, (), config, amp, None, loss_fn)["skipped"] == 1
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), before)
    assert all(torch.equal(optimizer.state[p]["step"], s) for p, s in zip(model.parameters(), steps_before))
    half = {k: v[:, :8].contiguous() for k, v in batch.items()}
    stats = update(model, optimizer, scheduler, half, (), config, amp, None, loss_fn)
    assert stats["skipped"] == 0 and all(math.isfinite(v) for v in stats.values())
    assert not torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), before)


def test_weights_published_from_the_gpu_arrive_in_one_copy():
    torch.manual_seed(0)
    actor_model = Net((4, 84, 84), 6)
    weights = FlatWeights(actor_model)
    learner_model = Net((4, 84, 84), 6).cuda()  # other weights: the next draws of the generator
    weights.load(learner_model)  # the first load makes the staging copy on the GPU
    with torch.no_grad():
        for param in learner_model.parameters():
            param.mul_(2)
    assert len(_waits_for_the_gpu(lambda: weights.load(learner_model))) == 1
    for a, b in zip(actor_model.parameters(), learner_model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())


def test_actions_are_sampled_on_the_gpu_without_waiting_for_it():
    """Central inference samples every batch on the device: torch.multinomial's checks waited twice per call."""
    logits = torch.randn(64, 6, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    actions: list[torch.Tensor] = []
    assert _waits_for_the_gpu(lambda: actions.append(sample_actions(logits, generator))) == []
    reference = torch.multinomial(torch.softmax(logits, -1), 1,
                                  generator=torch.Generator(device="cuda").manual_seed(0)).squeeze(-1)
    assert torch.equal(actions[0], reference)


@pytest.mark.parametrize("inference", ["actor", "central", "central --env_splits 2"])
def test_a_short_run_learns_on_the_gpu(tmp_path, inference):
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--inference", *inference.split(), "--num_actors", "2",
               "--envs_per_actor", "4", "--unroll_length", "5", "--batch_size", "8", "--learning_rate", "0.001", *IMPALA_RULE,
               "--entropy_cost", "0.01", "--total_steps", str(GPU_RUN_STEPS), "--savedir", str(tmp_path),
               "--xpid", "gpu"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "device cuda" in result.stdout
    output = result.stdout + result.stderr
    assert "Could not page-lock" not in output and "Could not release" not in output  # --pin_slots held
    assert "Could not capture" not in output  # central inference's graphs held (the update here is RMSprop's, eager)
    meta = json.loads((tmp_path / "gpu" / "meta.json").read_text())
    assert meta["end_reason"] == "finished" and meta["final_step"] >= GPU_RUN_STEPS
    with open(tmp_path / "gpu" / "logs.csv", newline="") as f:
        returns = [float(row[CSV_RETURN_COLUMN]) for row in csv.DictReader(f) if row.get(CSV_RETURN_COLUMN)]
    # A random CartPole policy averages about 22 and its mean over 100 episodes never nears 150; these
    # settings pass 100 by 60k steps on the CPU (tests/test_training.py).
    assert returns and returns[-1] >= 150, f"mean return {returns[-1] if returns else None} after {GPU_RUN_STEPS} steps"


def test_central_inference_on_the_gpu_serves_the_models_outputs_from_pinned_staging():
    from multiprocessing import Pipe

    from impala.channels import signal, take_signal
    from impala.inference import InferenceServer

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6).to(device).eval()
    buffers = create_buffers(BufferSpec(6, 4, (4, 84, 84), torch.uint8, 6))
    buffers["obs"].random_(0, 255)
    buffers["done"].zero_()
    positions = torch.tensor([[4, 1, 3, 2]])  # slots 4, 1, 3 at row 2
    server = InferenceServer(model, buffers, positions, device, amp=False, wait_s=0.0, seed=0)
    assert all(t.is_pinned() for t in server._staging.values())
    assert server._stream is not None and server._stream.priority < 0  # ahead of the learner's default stream
    main_end, actor_end = Pipe()
    server.connect(0, main_end)
    signal(actor_end)
    assert server.serve_once(timeout_s=5.0) == 1 and actor_end.poll(5.0)
    slots = torch.tensor([4, 1, 3])
    with torch.no_grad():
        expected, _ = model(buffers["obs"][slots, 2][None].to(device), buffers["done"][slots, 2][None].to(device))
    torch.testing.assert_close(buffers["policy_logits"][slots, 2], expected.policy_logits[0].cpu())
    torch.testing.assert_close(buffers["baseline"][slots, 2], expected.baseline[0].cpu())
    assert ((buffers["action"][slots, 2] >= 0) & (buffers["action"][slots, 2] < 6)).all()
    assert (buffers["action"][[0, 2, 5], 2] == -1).all()  # slots nobody asked about keep their poison
    with torch.no_grad():  # an update, then its publish: the next batch acts with it, on the server's stream
        for param in model.parameters():
            param.mul_(1.5)
    server.load_weights(model)
    assert take_signal(actor_end)
    signal(actor_end)
    assert server.serve_once(timeout_s=5.0) == 1 and actor_end.poll(5.0)
    with torch.no_grad():
        expected, _ = model(buffers["obs"][slots, 2][None].to(device), buffers["done"][slots, 2][None].to(device))
    torch.testing.assert_close(buffers["policy_logits"][slots, 2], expected.policy_logits[0].cpu())


@pytest.mark.parametrize("amp", [False, True])
def test_central_inference_replays_a_cuda_graph_per_batch_size_and_weight_copy(amp):
    """The graphed server (--cuda_graph) answers as the eager one does, for batches of 1, 3 and all 6 clients (padded
    to 1, 4 and 6 clients' rows), with the weights published after its graphs were captured."""
    from multiprocessing import Pipe

    from impala.channels import signal, take_signal
    from impala.inference import InferenceServer

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6).to(device).eval()
    clients, envs = 6, 2
    buffers = create_buffers(BufferSpec(clients * envs, 3, (4, 84, 84), torch.uint8, 6))
    buffers["obs"].random_(0, 255)
    buffers["done"].copy_(torch.rand(buffers["done"].shape) < 0.5)
    positions = torch.zeros((clients, envs + 1), dtype=torch.int64)
    positions[:, :-1] = torch.arange(clients * envs).flip(0).view(clients, envs)  # client c: two slots, row 1
    positions[:, -1] = 1
    servers = {graphed: InferenceServer(model, buffers, positions, device, amp, wait_s=0.0, seed=0, graphed=graphed)
               for graphed in (True, False)}
    assert servers[True].graphed and not servers[False].graphed
    ends = {}
    for graphed, server in servers.items():
        for client in range(clients):
            server_end, actor_end = Pipe()
            server.connect(client, server_end)
            ends[graphed, client] = actor_end

    def serve(graphed: bool, asking: list[int]) -> dict[str, torch.Tensor]:
        slots = positions[asking, :-1].flatten()
        for field in ("policy_logits", "baseline", "action"):
            buffers[field][slots, 1] = -1
        for client in asking:
            signal(ends[graphed, client])
        assert servers[graphed].serve_once(timeout_s=5.0) == len(asking)
        assert all(take_signal(ends[graphed, client]) for client in asking)
        return {field: buffers[field][slots, 1].clone() for field in ("policy_logits", "baseline", "action")}

    def check(asking: list[int]) -> None:
        graphed, eager = serve(True, asking), serve(False, asking)
        tolerance = {"atol": 2e-2, "rtol": 2e-2} if amp else {"atol": 1e-3, "rtol": 1e-3}
        torch.testing.assert_close(graphed["policy_logits"], eager["policy_logits"], **tolerance)
        torch.testing.assert_close(graphed["baseline"], eager["baseline"], **tolerance)
        assert ((graphed["action"] >= 0) & (graphed["action"] < 6)).all()

    for asking in ([0], [1, 4, 5], list(range(clients))):
        check(asking)
    assert sorted(rows for _, rows in servers[True]._graphs) == [2, 8, 12]
    with torch.no_grad():  # an update, published: the next batch acts with it from the other weight copy's graph
        for param in model.parameters():
            param.mul_(1.5)
    for server in servers.values():
        server.load_weights(model)
    check([1, 4, 5])
    assert len(servers[True]._graphs) == 4
    with torch.no_grad():  # a policy that always picks action 4, published into the first copy, graphed already
        model.policy.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 1e4, 0.0]))
    for server in servers.values():
        server.load_weights(model)
    check(list(range(clients)))
    assert (serve(True, list(range(clients)))["action"] == 4).all()
    assert len(servers[True]._graphs) == 4


@pytest.mark.parametrize("graphed, slots", [(True, 12), (False, 8)])
def test_a_graphed_gpu_learner_gives_every_env_two_unrolls_of_slots(tmp_path, graphed, slots):
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--num_actors", "3", "--envs_per_actor", "2",
               "--unroll_length", "5", "--batch_size", "2", "--total_steps", "200", "--savedir", str(tmp_path),
               "--xpid", "slots", "--cuda_graph" if graphed else "--no-cuda_graph"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # graphed, 2 x 3 x 2 = 12; eager, the fewest that cannot deadlock, 3 x 2 + 2 = 8 (as on the CPU)
    assert f"3 actors x 2 envs, {slots} slots, T=5, B=2, device cuda" in result.stdout


def test_discounted_sums_on_the_gpu_are_the_matrix_and_equal_the_cpus():
    """On a GPU V-trace's sums come from the matrix of discount products (`vtrace.as_matrix`), at the learner's shapes
    and an episode end in every column; the CPU's scan by doubling is the reference (tests/test_vtrace.py holds it to
    the loop)."""
    generator = torch.Generator().manual_seed(3)
    for steps, batch in ((32, 4), (32, 32), (80, 32)):
        deltas = torch.randn(steps, batch, generator=generator)
        coefficients = 0.99 * torch.rand(steps, batch, generator=generator)
        coefficients[steps // 2] = 0.0
        on_gpu = deltas.cuda()
        assert vtrace.as_matrix(on_gpu)
        torch.testing.assert_close(vtrace.discounted_sums(on_gpu, coefficients.cuda()).cpu(),
                                   vtrace.discounted_sums(deltas, coefficients), rtol=0, atol=1e-5)


def test_two_graphed_inference_threads_serve_at_once_what_the_model_computes():
    """--inference_threads 2: two servers capture and replay their graphs in threads of their own, at the same time,
    each on its stream; every answer is the model's output for its client's observations, before and after a
    publish."""
    import threading
    from multiprocessing import Pipe

    from impala.channels import signal, take_signal
    from impala.inference import InferenceServers

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6).to(device).eval()
    clients, envs = 4, 2
    buffers = create_buffers(BufferSpec(clients * envs, 2, (4, 84, 84), torch.uint8, 6))
    buffers["done"].zero_()
    positions = torch.zeros((clients, envs + 1), dtype=torch.int64)
    positions[:, :-1] = torch.arange(clients * envs).view(clients, envs)  # client c: slots 2c and 2c + 1, row 0
    servers = InferenceServers(model, buffers, positions, device, amp=False, wait_s=0.0, seeds=[0, 1], graphed=True)
    ends = []
    for client in range(clients):
        server_end, actor_end = Pipe()
        servers.connect(client, server_end)
        ends.append(actor_end)
    stop = threading.Event()
    threads = [threading.Thread(target=server.serve, args=(stop,), daemon=True) for server in servers.servers]
    for thread in threads:
        thread.start()
    try:
        for round_ in range(12):
            if round_ == 6:
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(1.5)
                servers.load_weights(model)
            buffers["obs"].random_(0, 255)
            buffers["policy_logits"].fill_(float("nan"))
            for end in ends:
                signal(end)
            assert all(end.poll(10.0) and take_signal(end) for end in ends), f"round {round_}: every client answered"
            with torch.no_grad():
                expected, _ = model(buffers["obs"][:, 0][None].to(device), buffers["done"][:, 0][None].to(device))
            torch.testing.assert_close(buffers["policy_logits"][:, 0], expected.policy_logits[0].cpu(), atol=1e-3, rtol=1e-3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    assert all(server.graphed and server._graphs for server in servers.servers)
    assert [server.served for server in servers.servers] == [24, 24]


def test_the_learners_capture_and_central_inferences_take_turns(monkeypatch: pytest.MonkeyPatch):
    """The learner captures its first update while central inference meets its first batch (`cudagraphs`): the
    inference thread serves that batch eagerly instead of synchronizing the device inside the learner's capture, and
    captures at its next batch; both keep their graphs (either capture once fell back to eager launches for good)."""
    import threading
    import time
    from multiprocessing import Pipe

    from impala.channels import signal, take_signal
    from impala.inference import InferenceServer

    device = torch.device("cuda")
    config = Config(unroll_length=20, batch_size=16, cuda_graph=True)
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6).to(device)
    optimizer, scheduler = learner.make_optimizer(model, config)
    update = learner.update_function(config, device)
    assert isinstance(update, learner.GraphedUpdate)
    buffers = create_buffers(BufferSpec(2, 2, (4, 84, 84), torch.uint8, 6))
    buffers["obs"].random_(0, 255)
    buffers["done"].zero_()
    server = InferenceServer(model, buffers, torch.tensor([[0, 1, 0]]), device, amp=False, wait_s=0.0, seed=0,
                             graphed=True)
    main_end, actor_end = Pipe()
    server.connect(0, main_end)
    capturing = threading.Event()
    real_steps = learner._update_steps

    def slow_steps(*args, **kwargs):  # inside the capture: give the inference thread time to serve meanwhile
        if torch.cuda.is_current_stream_capturing():
            capturing.set()
            time.sleep(0.5)
        return real_steps(*args, **kwargs)

    monkeypatch.setattr(learner, "_update_steps", slow_steps)
    served: list[int] = []

    def serve_while_the_learner_captures():
        assert capturing.wait(60)
        signal(actor_end)
        served.append(server.serve_once(timeout_s=30.0))
        served.append(len(server._graphs))

    thread = threading.Thread(target=serve_while_the_learner_captures)
    try:
        thread.start()
        stats = update(model, optimizer, scheduler, _random_gpu_batch(config, device), (), config)
        thread.join(60)
        assert capturing.is_set() and served == [1, 0]  # answered, eagerly: no capture begun inside the learner's
        assert actor_end.poll(5.0) and take_signal(actor_end)
        assert not update.failed and update._graph is not None and stats["skipped"] == 0
        signal(actor_end)  # the next batch, the learner's capture over: captured now
        assert server.serve_once(timeout_s=30.0) == 1 and actor_end.poll(5.0) and take_signal(actor_end)
        assert server.graphed and len(server._graphs) == 1
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
    finally:
        server._selector.close()
        main_end.close()
        actor_end.close()


def test_a_failed_capture_leaves_the_thread_on_its_own_stream():
    """torch.cuda.graph's exit raises before it leaves its capture stream; every later launch of the thread would
    go there (`cudagraphs.capture` puts it back)."""
    from impala import cudagraphs

    before = torch.cuda.current_stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError), cudagraphs.CAPTURE_LOCK, cudagraphs.capture(graph):
        torch.ones(4, device="cuda").sum().item()  # waiting for the GPU is not allowed while capturing
    assert torch.cuda.current_stream() == before and torch.cuda.current_device() == before.device.index
    assert torch.ones(4, device="cuda").sum().item() == 4  # the thread launches and waits as before
    # The allocator counts no capture under way: it empties its cache (which checks that none is), and the next
    # capture (which empties it as it begins) succeeds and replays.
    torch.cuda.empty_cache()
    static = torch.zeros(4, device="cuda")
    again = torch.cuda.CUDAGraph()
    with cudagraphs.CAPTURE_LOCK, cudagraphs.capture(again):
        static.add_(1)
    again.replay()
    assert static.sum().item() == 4


def test_a_run_with_a_graphed_update_and_graphed_central_inference_keeps_both(tmp_path):
    """Adam (the update one CUDA graph) and central inference graphed, in one short run: neither capture falls back."""
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--inference", "central", "--num_actors", "2",
               "--envs_per_actor", "4", "--unroll_length", "5", "--batch_size", "8", "--total_steps", "20000",
               "--savedir", str(tmp_path), "--xpid", "graphs"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "device cuda" in result.stdout and "Could not capture" not in output, output[-3000:]


def test_the_gpu_generator_that_draws_the_minibatch_orders_is_saved_and_restored_without_a_wait() -> None:
    """On a GPU `draw_orders` draws from the CUDA device's generator: its state goes into the checkpoint (read
    on the host, no wait for the device) and a resume draws on from it."""
    device = torch.device("cuda")
    saved: dict[str, object] = {}
    assert _waits_for_the_gpu(lambda: saved.update(learner.orders_generator_state(device))) == []
    assert saved["device"] == "cuda"
    drawn = torch.randperm(50, device=device)
    torch.manual_seed(0)
    learner.load_orders_generator_state(saved, device, Path("model.tar"))
    assert torch.equal(torch.randperm(50, device=device), drawn)
