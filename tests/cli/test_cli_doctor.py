"""`remat doctor` end to end: exit 0 when healthy, 1 when memory grows or a snapshot ran
out, 2 on bad input (a tiny --module model, CPU)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from remat.cli import app

runner = CliRunner()

JOB = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build():
    return Net(), torch.randn(256, 16)


losses = []


def leaky_step(model, batch, optimizer):
    loss = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss)


def broken_step(model, batch):
    raise RuntimeError("boom")
'''


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("doctor") / "job.py"
    path.write_text(JOB)
    return str(path)


def _doctor(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["doctor", "--device", "cpu", *args])
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


def test_healthy_job_exits_0(job: str) -> None:
    code, out = _doctor("--module", f"{job}:build", "--steps", "3", "--optimizer", "none")
    assert code == 0, out
    assert "remat doctor: module:" in out and "3 steps on cpu" in out
    assert "blocks.0" in out and "Healthy: memory is steady after the first step." in out


def test_leaky_train_step_exits_1_with_the_holder(job: str) -> None:
    code, out = _doctor("--module", f"{job}:build", "--train-step", f"{job}:leaky_step")
    assert code == 1, out
    assert "Tensors kept across steps (problem)" in out and "losses in" in out
    assert "loss.item()" in out and "Unhealthy: 1 problem" in out


def test_no_zero_grad_exits_1(job: str) -> None:
    code, out = _doctor("--module", f"{job}:build", "--no-zero-grad", "--json", "-")
    assert code == 1, out
    data = json.loads(out[out.index("{"):])
    assert data["healthy"] is False and data["zero_grad"] is False
    assert data["findings"][0]["cause"] == "gradients_kept"
    assert data["steps"][1]["held_bytes"] == {"gradients": 2 * (16 * 16 + 16) * 4}


def test_snapshot_out_of_memory_exits_1(tmp_path: Path) -> None:
    mib = 1 << 20
    blocks = [{"address": 0, "size": 12 * mib, "requested_size": 12 * mib,
               "state": "active_allocated", "frames": []},
              {"address": 12 * mib, "size": 8 * mib, "requested_size": 8 * mib,
               "state": "inactive", "frames": []}]
    segments = [{"device": 0, "address": 0, "total_size": 20 * mib, "stream": 0,
                 "segment_type": "large", "blocks": blocks},
                {"device": 0, "address": 100 * mib, "total_size": 20 * mib, "stream": 0,
                 "segment_type": "large", "blocks": [
                     {**b, "address": b["address"] + 100 * mib} for b in blocks]}]
    trace = [{"action": "oom", "addr": 0, "size": 10 * mib, "stream": 0,
              "device_free": 2 * mib, "frames": []}]
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [trace]}))
    code, out = _doctor("--snapshot", str(path))
    assert code == 1, out
    assert "Fragmentation (problem)" in out and "expandable_segments:True" in out
    assert "Failed request" in out and "10.00 MiB" in out


@pytest.mark.parametrize(("args", "says"), [
    (["--train-step", "{job}:leaky_step", "--no-zero-grad"], "--no-zero-grad changes"),
    (["--train-step", "{job}:missing"], "has no function 'missing'"),
    (["--train-step", "{job}:broken_step"], "RuntimeError: boom"),
    (["--snapshot", "{job}"], "is not a pickle file"),
])
def test_bad_input_exits_2(job: str, args: list[str], says: str) -> None:
    args = [a.format(job=job) for a in args]
    module = [] if args[0] == "--snapshot" else ["--module", f"{job}:build"]
    code, out = _doctor(*module, *args)
    assert code == 2, out
    assert says in out and "Traceback" not in out


def test_readme_example_names_the_leak_and_its_fix_is_healthy() -> None:
    args = ["--module", "examples/my_model.py:build", "--batch", "1", "--seq", "16",
            "--steps", "3"]
    code, out = _doctor(*args, "--train-step", "examples/leaky_train.py:train_step")
    assert code == 1, out
    assert "predictions in leaky_train.py (list) grows by 16.00 KiB per step" in out
    code, out = _doctor(*args, "--train-step", "examples/leaky_train.py:fixed_train_step")
    assert code == 0, out
