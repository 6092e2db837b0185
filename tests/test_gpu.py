"""The CUDA paths: a learner update on the GPU (pinned staging, bf16 autocast) and a short run with the
learner and central inference on the GPU. Skipped where no CUDA device is present; `pytest -m gpu`
selects them on a GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impala import learner
from impala.buffers import BufferSpec, create_buffers
from impala.config import Config
from impala.model import Net, use_amp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


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
    buffers["action"].random_(0, 6)
    buffers["policy_logits"].normal_()
    staging = learner.BatchStaging(buffers, config.batch_size, pin=True)
    assert all(t.is_pinned() for t in staging.tensors.values())
    staging.fill(buffers, [0, 2, 4, 6])
    batch, core_state = staging.to(device)
    assert batch["obs"].device.type == "cuda" and batch["obs"].shape == (21, 4, 4, 84, 84)
    before = [p.detach().clone() for p in model.parameters()]
    stats = learner.update(model, optimizer, scheduler, batch, core_state, config, amp=use_amp(None, device, "shallow"))
    assert stats["skipped"] == 0
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("inference", ["actor", "central"])
def test_a_short_run_learns_on_the_gpu(tmp_path, inference):
    command = [sys.executable, "run.py", "--env", "CartPole-v1", "--inference", inference, "--num_actors", "2",
               "--envs_per_actor", "4", "--unroll_length", "5", "--batch_size", "8", "--learning_rate", "0.001",
               "--entropy_cost", "0.01", "--total_steps", "40000", "--savedir", str(tmp_path), "--xpid", "gpu"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "device cuda" in result.stdout
    meta = json.loads((tmp_path / "gpu" / "meta.json").read_text())
    assert meta["end_reason"] == "finished" and meta["final_step"] >= 40000
