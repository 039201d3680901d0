"""benchmarks/peak_windows.py: the peak model predicts every window exactly."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peak_windows.py"


def _errors(capsys: pytest.CaptureFixture[str], *argv: str) -> list[int]:
    spec = importlib.util.spec_from_file_location("remat_peak_windows", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--seq", "128", "--batch", "8", *argv]) == 0
    out = capsys.readouterr().out
    assert "choice:" in out
    return [int(m.replace(",", "")) for m in re.findall(r"^\S+ +[\d,]+ +[\d,]+ +([+-][\d,]+)$",
                                                        out, flags=re.M)]


#: A sample of model x precision in which each model and each precision occurs once:
#: bf16 Llama used to be under-predicted by one hidden state per checkpointed block before
#: the window (NOTE [ Who keeps a hidden state ] in block_run.py); fp32 GPT has tied
#: weights, dropout and no fp32 norm copies.
CASES = [("llama-small", "bf16"), ("gpt-small", "fp32")]


@pytest.mark.parametrize(("model", "dtype"), CASES, ids=[f"{m}-{d}" for m, d in CASES])
def test_peak_model_is_exact_in_every_window(capsys: pytest.CaptureFixture[str], model: str,
                                              dtype: str) -> None:
    assert _errors(capsys, "--model", model, "--dtype", dtype) == []
