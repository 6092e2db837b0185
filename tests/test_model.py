"""Tests for impala/model.py: output shapes, the LSTM reset at episode starts, the initial state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from impala.model import CastTorso, FlatWeights, Net, bf16_is_fast, sample_actions, use_amp

ATARI_SHAPE = (4, 84, 84)
NUM_ACTIONS = 6


def _obs(shape: tuple[int, ...], T: int, B: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if len(shape) == 3:
        return torch.randint(0, 256, (T, B, *shape), dtype=torch.uint8, generator=generator)
    return torch.randn((T, B, *shape), generator=generator)


@pytest.mark.parametrize("use_lstm", [False, True])
@pytest.mark.parametrize(("model", "shape"), [("shallow", ATARI_SHAPE), ("resnet", ATARI_SHAPE), ("mlp", (4,)),
                                             ("shallow", (3, 48, 40)), ("shallow", (1, 36, 36)), ("resnet", (3, 7, 7))])
@pytest.mark.parametrize("T", [1, 3])
def test_output_shapes(model: str, shape: tuple[int, ...], use_lstm: bool, T: int) -> None:
    torch.manual_seed(0)
    B = 2
    net = Net(shape, NUM_ACTIONS, model=model, use_lstm=use_lstm, hidden_size=32)
    assert net.model == model and net.use_lstm == use_lstm
    with torch.no_grad():
        output, core_state = net(_obs(shape, T, B), torch.zeros(T, B, dtype=torch.bool), net.initial_state(B))
    assert output.policy_logits.shape == (T, B, NUM_ACTIONS)
    assert output.baseline.shape == (T, B)
    assert output.policy_logits.dtype == torch.float32
    assert torch.isfinite(output.policy_logits).all() and torch.isfinite(output.baseline).all()
    if use_lstm:
        assert [s.shape for s in core_state] == [(1, B, 32), (1, B, 32)]
    else:
        assert core_state == ()


def test_auto_model_picks_by_observation_shape() -> None:
    assert Net(ATARI_SHAPE, NUM_ACTIONS).model == "shallow"
    assert Net((3, 36, 64), 2).model == "shallow"
    assert Net((4,), 2).model == "mlp"
    assert Net((3, 7, 7), 2).model == "mlp"  # too small for the Atari net's convolutions
    assert Net((3, 35, 64), 2).model == "mlp"


def test_the_atari_nets_first_linear_layer_takes_what_its_convolutions_leave() -> None:
    assert Net(ATARI_SHAPE, NUM_ACTIONS).torso.fc.in_features == 64 * 7 * 7  # the checkpoints of every Atari run
    assert Net((3, 48, 40), NUM_ACTIONS, model="shallow").torso.fc.in_features == 64 * 2 * 1
    with pytest.raises(ValueError, match="at least 36x36 pixels, got 35x84"):
        Net((4, 35, 84), NUM_ACTIONS, model="shallow")


def test_image_models_refuse_vector_observations() -> None:
    with pytest.raises(ValueError, match="image observations"):
        Net((4,), 2, model="shallow")


def test_uint8_observations_are_scaled_to_unit_range() -> None:
    torch.manual_seed(0)
    net = Net(ATARI_SHAPE, NUM_ACTIONS, model="shallow")
    obs = _obs(ATARI_SHAPE, 1, 2)
    done = torch.zeros(1, 2, dtype=torch.bool)
    with torch.no_grad():
        from_bytes, _ = net(obs, done)
        from_floats, _ = net(obs.float() / 255.0, done)
    torch.testing.assert_close(from_bytes.policy_logits, from_floats.policy_logits)
    torch.testing.assert_close(from_bytes.baseline, from_floats.baseline)


@pytest.mark.parametrize("model", ["shallow", "resnet"])
def test_uint8_frames_under_bfloat16_autocast_give_bit_for_bit_what_float_frames_do(model: str) -> None:
    """Under autocast the frames are scaled straight in bfloat16, skipping the float32 copy: every one of
    the 256 byte values, and so the whole forward and backward, must come out exactly as before."""
    torch.manual_seed(0)
    net = Net(ATARI_SHAPE, NUM_ACTIONS, model=model)
    obs = _obs(ATARI_SHAPE, 2, 2)
    obs[0, 0, 0, :4, :64] = torch.arange(256, dtype=torch.uint8).view(4, 64)  # every value at least once
    done = torch.zeros(2, 2, dtype=torch.bool)
    results = []
    for frames in (obs, obs.float() / 255.0):  # the second is how frames were scaled before
        net.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output, _ = net(frames, done)
        (output.policy_logits.sum() + output.baseline.sum()).backward()
        results.append([output.policy_logits, output.baseline, *(p.grad.clone() for p in net.parameters())])
    for from_bytes, from_floats in zip(*results, strict=True):
        assert torch.equal(from_bytes, from_floats)
    scaled = Net._scale_frames(torch.arange(256, dtype=torch.uint8))
    assert scaled.dtype == torch.float32 and torch.equal(scaled, torch.arange(256.0) / 255.0)


@pytest.mark.parametrize("model", ["shallow", "resnet"])
def test_float32_frames_on_the_cpu_reach_the_torso_channels_last_with_the_outputs_and_gradients_of_nchw(
        model: str) -> None:
    torch.manual_seed(0)
    net = Net(ATARI_SHAPE, NUM_ACTIONS, model=model)
    obs = _obs(ATARI_SHAPE, 3, 2)
    seen = []
    net.torso.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
    results = []
    for layout in ("net", "nchw"):
        net.zero_grad()
        if layout == "net":
            output, _ = net(obs, torch.zeros(3, 2, dtype=torch.bool))
            logits, baseline = output.policy_logits.flatten(0, 1), output.baseline.flatten()
        else:  # the same net with the frames handed to the torso as they are (NCHW)
            features = net.torso(obs.flatten(0, 1).float() / 255.0)
            logits, baseline = net.policy(features), net.baseline(features).squeeze(-1)
        (logits.sum() + baseline.sum()).backward()
        results.append([logits, baseline, *(p.grad.clone() for p in net.parameters())])
    assert seen[0].is_contiguous(memory_format=torch.channels_last) and not seen[0].is_contiguous()
    assert seen[1].is_contiguous()
    for ours, nchw in zip(*results, strict=True):
        # float32 sums in another order: on an AVX512 Xeon the ResNet's weight gradients channels last differ by up
        # to 8e-5 of their largest entry (against float64, NCHW's by 2e-6); a layout mixed up would differ by ~1.
        torch.testing.assert_close(ours, nchw, rtol=0, atol=1e-3 * nchw.abs().max().item())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bfloat16 frames keep their layout
        net(obs, torch.zeros(3, 2, dtype=torch.bool))
    assert seen[2].dtype == torch.bfloat16 and seen[2].is_contiguous()


@pytest.mark.parametrize("model", ["shallow", "resnet"])
def test_a_torso_cast_once_per_version_acts_as_autocast_does_and_follows_new_versions_only(model: str) -> None:
    torch.manual_seed(0)
    net = Net(ATARI_SHAPE, NUM_ACTIONS, model=model, use_lstm=True, hidden_size=16)
    cast = CastTorso(net, torch.bfloat16)
    obs, done = _obs(ATARI_SHAPE, 2, 3), torch.zeros(2, 3, dtype=torch.bool)
    state = tuple(torch.randn(s.shape) for s in net.initial_state(3))

    def outputs(module: Net) -> list[torch.Tensor]:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            output, core_state = module(obs, done, state)
        return [output.policy_logits, output.baseline, *core_state]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    # The ResNet's cast torso acts channels last (`Net._cpu_layout`): so must its reference, for the same bits.
    reference = copy.deepcopy(net)
    if model == "resnet":
        reference.torso.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        reference.channels_last_frames = True
    before = outputs(reference)
    assert same(outputs(cast.refresh(0)), before)  # bit for bit
    assert all(p.dtype == torch.bfloat16 for p in cast.net.torso.parameters())
    convolutions = [p for p in cast.net.torso.parameters() if p.dim() == 4]
    layout = torch.channels_last if model == "resnet" else torch.contiguous_format
    assert convolutions and all(p.is_contiguous(memory_format=layout) for p in convolutions)
    assert cast.net.channels_last_frames == (model == "resnet")
    torch.testing.assert_close(before[0], outputs(net)[0], atol=2e-2, rtol=2e-2)  # the layouts differ by rounding
    assert cast.net.policy is net.policy and cast.net.core is net.core  # the heads and LSTM are the model's own
    with torch.no_grad():
        for param in net.torso.parameters():
            param.add_(0.01)
    reference.load_state_dict(net.state_dict())  # copied into its channels-last weights
    after = outputs(reference)
    assert not same(after, before)
    assert same(outputs(cast.refresh(0)), before)  # the same version: the weights cast at it
    assert same(outputs(cast.refresh(1)), after)


def test_initial_state() -> None:
    net = Net((4,), 2, use_lstm=True, hidden_size=16)
    h, c = net.initial_state(5)
    assert h.shape == c.shape == (1, 5, 16)
    assert not h.any() and not c.any()
    assert Net((4,), 2, use_lstm=False).initial_state(5) == ()


def _random_state(net: Net, batch_size: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randn(s.shape, generator=generator) for s in net.initial_state(batch_size))


def test_lstm_state_is_reset_where_done() -> None:
    """The output at a done step (and after it) equals the output of a run started from a zero state."""
    torch.manual_seed(0)
    net = Net((4,), 3, model="mlp", use_lstm=True, hidden_size=16)
    T, B = 5, 2
    obs = _obs((4,), T, B)
    done = torch.zeros(T, B, dtype=torch.bool)
    done[2, 0] = True  # env 0 starts a new episode at t=2; env 1 does not
    state = _random_state(net, B)
    with torch.no_grad():
        output, _ = net(obs, done, state)
        fresh, _ = net(obs[2:, :1], done[2:, :1], net.initial_state(1))
        continued, _ = net(obs[2:, 1:], done[2:, 1:], net.initial_state(1))
    torch.testing.assert_close(output.policy_logits[2:, 0], fresh.policy_logits[:, 0])
    torch.testing.assert_close(output.baseline[2:, 0], fresh.baseline[:, 0])
    # Where no episode began, the past still matters: env 1's outputs differ from a zero-state run.
    assert not torch.allclose(output.policy_logits[2:, 1], continued.policy_logits[:, 0])
    # And env 0 before its reset depended on the state it was given.
    with torch.no_grad():
        from_zero, _ = net(obs[:2, :1], done[:2, :1], net.initial_state(1))
    assert not torch.allclose(output.policy_logits[:2, 0], from_zero.policy_logits[:, 0])


def test_lstm_unroll_equals_one_step_at_a_time() -> None:
    """The learner's [T, B] forward must see what the actor saw stepping with T=1."""
    torch.manual_seed(0)
    net = Net((4,), 3, model="mlp", use_lstm=True, hidden_size=16)
    T, B = 6, 3
    obs = _obs((4,), T, B)
    done = torch.zeros(T, B, dtype=torch.bool)
    done[0, :] = True
    done[3, 1] = True
    done[4, 2] = True
    initial = _random_state(net, B)
    with torch.no_grad():
        unrolled, final_state = net(obs, done, initial)
        state = initial
        stepped = []
        for t in range(T):
            output, state = net(obs[t : t + 1], done[t : t + 1], state)
            stepped.append(output.policy_logits)
    torch.testing.assert_close(unrolled.policy_logits, torch.cat(stepped))
    for a, b in zip(final_state, state):
        torch.testing.assert_close(a, b)


def test_lstm_state_stays_float32_under_bfloat16_autocast() -> None:
    """--amp on a CPU: the actor steps the shallow net + LSTM one obs at a time under bfloat16 autocast and
    feeds (h, c) back; the state must stay float32 and match the learner's [T, B] unroll of the same rows."""
    torch.manual_seed(0)
    net = Net((4, 84, 84), 6, model="shallow", use_lstm=True, hidden_size=32)
    T, B = 5, 2
    obs = torch.randint(0, 256, (T, B, 4, 84, 84), dtype=torch.uint8)
    done = torch.zeros(T, B, dtype=torch.bool)
    done[2, 1] = True
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = net.initial_state(B)
        for t in range(T):
            output, state = net(obs[t : t + 1], done[t : t + 1], state)
            assert [s.dtype for s in state] == [torch.float32, torch.float32], t
        unrolled, learner_state = net(obs, done, net.initial_state(B))
    assert output.policy_logits.dtype == torch.float32
    for actor, learner in zip(state, learner_state):
        torch.testing.assert_close(actor, learner, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output.policy_logits[0], unrolled.policy_logits[-1], atol=1e-5, rtol=1e-5)


def _cpuinfo(path: Path, vendor: str | None, flags: str) -> Path:
    """A /proc/cpuinfo of two processors, the first with `vendor` (None: no vendor_id line, as on ARM) and `flags`."""
    first = (f"vendor_id\t: {vendor}\n" if vendor else "") + f"flags\t\t: fpu {flags} sse2\n"
    path.write_text(f"processor\t: 0\n{first}\nprocessor\t: 1\nvendor_id\t: Other\nflags\t\t: amx_bf16\n")
    return path


@pytest.mark.parametrize(("vendor", "flags", "fast"), [
    ("GenuineIntel", "avx512_bf16 amx_bf16 amx_tile", True),  # Sapphire Rapids and later: AMX
    ("GenuineIntel", "avx512f avx512_bf16 avx512_fp16", False),  # AVX512-BF16 alone: float32 outran it here
    ("AuthenticAMD", "avx512f avx512_bf16", True),  # Zen 4
    ("AuthenticAMD", "avx2 fma", False),
    (None, "fp asimd bf16", True),  # not x86 (aarch64's lines): oneDNN's answer alone
])
def test_bfloat16_is_on_by_default_only_on_cpus_where_it_outran_float32(tmp_path: Path, vendor: str | None,
                                                                       flags: str, fast: bool) -> None:
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # this machine's oneDNN has bfloat16 kernels
    cpuinfo = _cpuinfo(tmp_path / "cpuinfo", vendor, flags)
    assert bf16_is_fast(torch.device("cpu"), cpuinfo) == (fast and native)
    assert bf16_is_fast(torch.device("cpu"), tmp_path / "unreadable") == native


def test_amp_by_default_where_bfloat16_is_fast_for_convolutional_nets_only() -> None:
    fast = bf16_is_fast(torch.device("cpu"))
    assert [use_amp(None, torch.device("cpu"), model) for model in ("shallow", "resnet", "mlp")] == [fast, fast, False]
    assert use_amp(True, torch.device("cpu"), "mlp") and not use_amp(False, torch.device("cpu"), "shallow")


def test_feed_forward_outputs_do_not_depend_on_done() -> None:
    torch.manual_seed(0)
    net = Net((4,), 3, model="mlp")
    obs = _obs((4,), 3, 2)
    with torch.no_grad():
        a, _ = net(obs, torch.zeros(3, 2, dtype=torch.bool))
        b, _ = net(obs, torch.ones(3, 2, dtype=torch.bool))
        c, _ = net(obs.flatten(0, 1)[None], torch.zeros(1, 6, dtype=torch.bool))  # time and batch folded
    torch.testing.assert_close(a.policy_logits, b.policy_logits)
    torch.testing.assert_close(a.policy_logits.flatten(0, 1), c.policy_logits[0])


def test_sample_actions_follow_the_policy() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.9, 0.0], [1.0, 0.0, 0.0]]).clamp_min(1e-30))
    generator = torch.Generator().manual_seed(0)
    actions = torch.stack([sample_actions(logits, generator) for _ in range(2000)])
    assert actions.shape == (2000, 2) and actions.dtype == torch.int64
    assert (actions[:, 1] == 0).all()
    assert (actions[:, 0] != 2).all()
    assert 0.85 < (actions[:, 0] == 1).float().mean() < 0.95


@pytest.mark.parametrize(("rows", "actions"), [(1, 1), (4, 2), (8, 6), (32, 18)])
def test_sampled_actions_are_torch_multinomials_from_the_same_generator(rows: int, actions: int) -> None:
    torch.manual_seed(rows)
    logits = 3 * torch.randn(rows, actions)
    if actions > 1:
        logits[0, 0] = float("-inf")  # never drawn
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(200):
        reference = torch.multinomial(torch.softmax(logits, -1), 1, generator=theirs).squeeze(-1)
        assert torch.equal(sample_actions(logits, ours), reference)


@pytest.mark.parametrize("use_lstm", [False, True])
def test_flat_shared_weights_act_as_before_and_load_another_model(use_lstm: bool) -> None:
    torch.manual_seed(0)
    model = Net((4, 84, 84), 6, use_lstm=use_lstm)
    source = Net((4, 84, 84), 6, use_lstm=use_lstm)  # other weights: the next draws of the generator
    obs = torch.randint(0, 255, (3, 2, 4, 84, 84), dtype=torch.uint8)
    done = torch.zeros(3, 2, dtype=torch.bool)
    state = model.initial_state(2)
    before, _ = model(obs, done, state)
    weights = FlatWeights(model)
    assert weights.tensor.is_shared()
    for param in model.parameters():  # views of the one tensor, each on a 64-byte boundary
        assert param.untyped_storage().data_ptr() == weights.tensor.untyped_storage().data_ptr()
        assert param.data_ptr() % 64 == 0
    after, _ = model(obs, done, state)
    assert torch.equal(before.policy_logits, after.policy_logits) and torch.equal(before.baseline, after.baseline)
    weights.load(source)
    for (name, a), b in zip(model.named_parameters(), source.parameters(), strict=True):
        assert torch.equal(a, b), name
    ours, _ = model(obs, done, state)
    theirs, _ = source(obs, done, state)
    assert torch.equal(ours.policy_logits, theirs.policy_logits) and torch.equal(ours.baseline, theirs.baseline)
