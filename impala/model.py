"""Policy/value networks: a torso (shallow Atari net, deep IMPALA ResNet or MLP), an optional LSTM
core reset at episode starts, and the policy and baseline heads.

Every network takes time-major inputs `[T, B, ...]` so that the learner (T = unroll length + 1) and
the actors (T = 1) share one forward.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

CoreState = tuple[torch.Tensor, ...]


class AgentOutput(NamedTuple):
    policy_logits: torch.Tensor  # [T, B, A]
    baseline: torch.Tensor  # [T, B]


class ShallowTorso(nn.Module):
    """The IMPALA/TorchBeast Atari net: three convolutions and a 512-unit layer (its input 64 x 7 x 7 on
    Atari's 84 x 84 frames). Images need at least `MIN_SIZE` pixels a side."""

    MIN_SIZE = 36  # the smallest side that leaves conv3 one pixel

    def __init__(self, in_channels: int, height: int = 84, width: int = 84) -> None:
        super().__init__()
        if min(height, width) < self.MIN_SIZE:
            raise ValueError(f"--model shallow needs images of at least {self.MIN_SIZE}x{self.MIN_SIZE} pixels, "
                             f"got {height}x{width}; use --model resnet or --model mlp")
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, stride=1)
        for kernel, stride in ((8, 4), (4, 2), (3, 1)):
            height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
        self.fc = nn.Linear(64 * height * width, 512)
        self.out_size = 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return F.relu(self.fc(x.flatten(1)))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


class ResNetTorso(nn.Module):
    """The deep IMPALA net: stages of 16/32/32 channels, each conv + max-pool + two residual blocks."""

    def __init__(self, in_channels: int, height: int = 84, width: int = 84) -> None:
        super().__init__()
        stages = []
        channels = in_channels
        for out_channels in (16, 32, 32):
            stages += [
                nn.Conv2d(channels, out_channels, kernel_size=3, padding=1),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                ResidualBlock(out_channels),
                ResidualBlock(out_channels),
            ]
            channels = out_channels
            height, width = (height + 1) // 2, (width + 1) // 2
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(channels * height * width, 256)
        self.out_size = 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stages(x))
        return F.relu(self.fc(x.flatten(1)))


class MLPTorso(nn.Module):
    def __init__(self, in_features: int, hidden_size: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden_size), nn.Tanh(), nn.Linear(hidden_size, hidden_size), nn.Tanh()
        )
        self.out_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.flatten(1))


class Net(nn.Module):
    """torso -> (LSTM) -> policy logits and baseline.

    `forward(obs [T, B, *obs_shape], done [T, B], core_state)`: `done[t]` says obs t starts a new
    episode, so the LSTM state is zeroed before it. uint8 observations are scaled to [0, 1] here.
    """

    def __init__(self, observation_shape: tuple[int, ...], num_actions: int, model: str = "auto",
                 use_lstm: bool = False, hidden_size: int = 256) -> None:
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self.num_actions = num_actions
        if model == "auto":  # the Atari net for images it fits, an MLP on the flattened observation otherwise
            model = ("shallow" if len(observation_shape) == 3 and min(observation_shape[1:]) >= ShallowTorso.MIN_SIZE
                     else "mlp")
        if model in ("shallow", "resnet") and len(observation_shape) != 3:
            raise ValueError(f"--model {model} needs image observations [C, H, W], got shape {observation_shape}")
        self.torso: ShallowTorso | ResNetTorso | MLPTorso
        if model == "shallow":
            self.torso = ShallowTorso(*observation_shape)
        elif model == "resnet":
            self.torso = ResNetTorso(*observation_shape)
        else:
            in_features = 1
            for size in observation_shape:
                in_features *= size
            self.torso = MLPTorso(in_features, hidden_size)
        self.model = model
        self.channels_last_frames = False  # under CPU autocast too (`_cpu_layout`)
        core_size = self.torso.out_size
        self.core = nn.LSTM(core_size, hidden_size, num_layers=1) if use_lstm else None
        if self.core is not None:
            core_size = hidden_size
        self.policy = nn.Linear(core_size, num_actions)
        self.baseline = nn.Linear(core_size, 1)
        if model in ("shallow", "resnet"):
            self._orthogonal_init()

    def _orthogonal_init(self) -> None:
        """The initialisation of Baselines' and CleanRL's Atari nets: orthogonal weights with gain sqrt(2)
        before ReLUs, 0.01 on the policy head (a near-uniform first policy), 1 on the value head, zero biases."""
        for module in self.torso.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(module.weight, gain=2 ** 0.5)
                assert module.bias is not None
                nn.init.zeros_(module.bias)
        for head, gain in ((self.policy, 0.01), (self.baseline, 1.0)):
            nn.init.orthogonal_(head.weight, gain=gain)
            nn.init.zeros_(head.bias)

    @property
    def use_lstm(self) -> bool:
        return self.core is not None

    def initial_state(self, batch_size: int) -> CoreState:
        """Zero core state for `batch_size` envs: `(h, c)` each [layers, B, H], or `()` without LSTM."""
        if self.core is None:
            return ()
        shape = (self.core.num_layers, batch_size, self.core.hidden_size)
        return torch.zeros(shape), torch.zeros(shape)

    def core_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One env's shape of each core-state tensor, [layers, H], as a rollout slot stores it."""
        return tuple((s.shape[0], s.shape[2]) for s in self.initial_state(1))

    def forward(self, obs: torch.Tensor, done: torch.Tensor, core_state: CoreState = ()
                ) -> tuple[AgentOutput, CoreState]:
        T, B = obs.shape[:2]
        x = self._cpu_layout(obs.flatten(0, 1))
        x = self._scale_frames(x) if x.dtype == torch.uint8 else x.float()  # both keep the layout
        features = self.torso(x)
        if self.core is not None:
            features, core_state = self._unroll_core(features.view(T, B, -1), done, core_state)
            features = features.flatten(0, 1)
        # The heads stay in float32 under autocast: bfloat16's 8-bit mantissa is too coarse for values
        # and logits that V-trace compares across learner and actors.
        with torch.autocast(features.device.type, enabled=False):
            features = features.float()
            logits = self.policy(features).view(T, B, self.num_actions)
            baseline = self.baseline(features).view(T, B)
        return AgentOutput(logits, baseline), core_state

    def _cpu_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Images that the CPU convolves in float32 go to the torso channels last (NHWC), the layout oneDNN
        computes in: the shallow net's forward and backward take 10-20% less time, the ResNet's 30%, and the
        ResNet acting at batch 8 half (BENCHMARKS.md). So does a ResNet actor's under autocast (`CastTorso`, which
        sets `channels_last_frames`): its bfloat16 forward at batch 8 takes a third of the time. The values are the
        same up to rounding. Reordered here, before scaling, a uint8 frame moves a quarter of the bytes. On a GPU,
        in a learner under autocast (the shallow net's update was 3.5% slower so) and in a shallow net's actor (the
        reorder cost what its convolutions gained), frames stay as they are."""
        if x.dim() == 4 and x.device.type == "cpu" and (self.channels_last_frames
                                                        or not torch.is_autocast_enabled("cpu")):
            return x.contiguous(memory_format=torch.channels_last)
        return x

    @staticmethod
    def _scale_frames(x: torch.Tensor) -> torch.Tensor:
        """uint8 frames to [0, 1], straight in the dtype the torso computes in. Under autocast that is
        bfloat16 (or float16), which holds 0..255 exactly and rounds the division as the float32 division
        and autocast's cast after it did, bit for bit, with a quarter of the memory traffic."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        return x.to(dtype).div_(255.0)

    def _unroll_core(self, features: torch.Tensor, done: torch.Tensor, core_state: CoreState
                     ) -> tuple[torch.Tensor, CoreState]:
        # The LSTM runs in float32 even under autocast: its (h, c) is fed back every step, so bfloat16 here
        # would compound rounding over an episode in the actor while the learner recomputes from row 0.
        with torch.autocast(features.device.type, enabled=False):
            features = features.float()
            core_state = tuple(s.float() for s in core_state)
            outputs = []
            not_done = (~done.bool()).float()
            for t in range(features.shape[0]):
                # Zero the state where obs t begins a new episode.
                mask = not_done[t].view(1, -1, 1)
                core_state = tuple(mask * s for s in core_state)
                assert self.core is not None
                output, core_state = self.core(features[t : t + 1], core_state)
                outputs.append(output)
        return torch.cat(outputs), core_state


class FlatWeights:
    """A model's parameters (float32, on the CPU) moved into one flat tensor in shared memory, each a view of
    it starting on a 64-byte boundary (where SIMD kernels expect it; results are bit-identical to before).
    Processes the model is handed to see new weights through that memory.

    `load(source)` copies in the weights of a model of the same architecture: parameter by parameter from the
    CPU; from a GPU, gathered there into the same layout and brought over in one copy (one wait), whatever
    the number of tensors.
    """

    ALIGN = 16  # elements of float32: 64 bytes

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        offsets, size = [], 0
        for param in self.params:
            offsets.append(size)
            size += -(-param.numel() // self.ALIGN) * self.ALIGN
        self.tensor = torch.zeros(size, dtype=self.params[0].dtype).share_memory_()
        with torch.no_grad():
            for param, offset in zip(self.params, offsets, strict=True):
                view = self.tensor[offset : offset + param.numel()].view_as(param)
                view.copy_(param)
                param.data = view
        self._on_device: torch.Tensor | None = None  # the same layout on the source's device

    def load(self, source: nn.Module) -> None:
        with torch.no_grad():
            sources = list(source.parameters())
            device = sources[0].device
            if device.type == "cpu":
                for target, value in zip(self.params, sources, strict=True):
                    target.copy_(value)
                return
            if self._on_device is None or self._on_device.device != device:
                self._on_device = torch.zeros_like(self.tensor, device=device)
            for target, value in zip(self.params, sources, strict=True):
                offset = target.storage_offset()
                self._on_device[offset : offset + target.numel()].view_as(target).copy_(value)
            self.tensor.copy_(self._on_device)


class CastTorso:
    """For acting under autocast: a net that shares `model`'s heads and LSTM (float32) and holds its own copy
    of the torso's weights in `dtype`, recast by `refresh(version)` only when the policy version changes.

    Autocast casts every float32 weight to `dtype` at every forward (for the shallow net's 512-unit layer,
    6.4 MB read per forward of a few envs); these are cast once per version, to the same bits, so the
    forward's results are the same. Whoever changes `model`'s weights must then change the version.
    """

    def __init__(self, model: Net, dtype: torch.dtype) -> None:
        self.model = model
        self.net = copy.deepcopy(model)
        self.net.policy, self.net.baseline, self.net.core = model.policy, model.baseline, model.core
        self.net.torso.to(dtype)
        # The ResNet's convolutions' weights and frames channels last (`_cpu_layout`): a third of its acting time in
        # bfloat16. Not the shallow net's: reordering its frames costs about what its convolutions gain (BENCHMARKS.md).
        if model.model == "resnet":
            self.net.torso.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            self.net.channels_last_frames = True
        self.version: int | None = None

    def refresh(self, version: int) -> Net:
        """The net, its torso's weights recast first if `version` is not the one they were cast at."""
        if version != self.version:
            with torch.no_grad():
                for target, source in zip(self.net.torso.parameters(), self.model.torso.parameters(), strict=True):
                    target.copy_(source)
            self.version = version
        return self.net


def bf16_is_fast(device: torch.device, cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether `device` computes bfloat16 faster than float32, so that autocast speeds it up rather than slows it:
    a GPU that has it natively; a CPU where oneDNN has bfloat16 kernels and, on x86, `x86_bf16_is_fast`."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    vendor, flags = _cpu_vendor_and_flags(cpuinfo)
    if vendor in ("GenuineIntel", "AuthenticAMD"):
        return native and x86_bf16_is_fast(vendor, flags)
    return native


def x86_bf16_is_fast(vendor: str, flags: frozenset[str]) -> bool:
    """On x86, oneDNN's bfloat16 outruns its float32 with AMX (Intel's Xeons since Sapphire Rapids, the GPU
    machines' hosts: an actor's forward 1.3 CPU-ms against 2.3), and with AVX512-BF16 on AMD (Zen 4: the learner 1.7x
    cheaper). Not with Intel's AVX512-BF16 alone (Cooper Lake, or a VM that hides AMX): there the learner took 1.6
    CPU-ms per agent step in bfloat16 against 1.1 in float32 (BENCHMARKS.md)."""
    return "amx_bf16" in flags or (vendor == "AuthenticAMD" and "avx512_bf16" in flags)


@functools.cache
def _cpu_vendor_and_flags(cpuinfo: Path) -> tuple[str, frozenset[str]]:
    """The vendor_id and the flags of the first processor in `cpuinfo` (/proc/cpuinfo): "" and none where it says
    neither (not x86) or cannot be read."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return "", frozenset()
    vendor, flags = "", frozenset[str]()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "vendor_id" and not vendor:
            vendor = value.strip()
        elif name == "flags":
            flags = frozenset(value.split())
            break
    return vendor, flags


def use_amp(amp: bool | None, device: torch.device, model: str) -> bool:
    """Resolve the `--amp` flag: explicit True/False, or None for "where it pays": convolutional nets on a
    device with native bfloat16 (an MLP is too small to gain and its values need the precision)."""
    if amp is None:
        return model != "mlp" and bf16_is_fast(device)
    return amp


def sample_actions(policy_logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One action per row of `policy_logits` [N, A], sampled from the softmax policy: int64 [N].

    The actions `torch.multinomial(probs, 1, generator=generator)` draws, from the same generator: its algorithm
    for one sample (the argmax of p / q, q ~ Exp(1)) without its checks that the probabilities are finite, not
    negative and not all 0, which a softmax's are. Those checks cost more than the draw on a CPU (46 against
    10 us per call at [4, 2], one thread) and made the host wait for a GPU twice per call. A NaN logit (a NaN
    observation) is acted on as action 0 rather than failing the actor; the learner then skips the update.
    """
    noise = torch.empty(policy_logits.shape, device=policy_logits.device).exponential_(generator=generator)
    return actions_from_noise(policy_logits, noise)


def actions_from_noise(policy_logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`sample_actions` given its draws `noise` (float32 Exp(1), the shape of `policy_logits`): what a CUDA graph
    replays, its noise drawn before each replay."""
    probs = F.softmax(policy_logits.float(), dim=-1)
    return (probs / noise).argmax(-1)
