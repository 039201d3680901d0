"""examples/train_fsdp.py under torchrun: 2 CPU processes (gloo), a few steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_fsdp.py"


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    # CPU ranks (gloo) even on a GPU machine: the script takes a GPU per rank when it sees
    # CUDA, and a one-GPU machine has none for rank 1 ("invalid device ordinal").
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(SCRIPT), *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )


def test_train_fsdp_runs_under_torchrun_and_the_loss_falls() -> None:
    done = _torchrun("--model", "llama-tiny", "--strategy", "sqrt", "--steps", "3",
                     "--grad-accum", "2", "--micro-batch", "2", "--dataset-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llama-tiny on 2 x cpu (gloo), strategy sqrt" in done.stdout
    losses = [float(m) for m in re.findall(r"^step \d+ \| loss ([0-9.]+)", done.stdout, re.M)]
    assert len(losses) == 3, done.stdout
    # 8 sequences, 4 per rank, 2 x 2 per step: every step sees the same data, so it memorises.
    assert losses[-1] < losses[0], losses
