"""PyTorch Lightning: remat.integrations.lightning.RematCallback in ``Trainer.fit``
(examples/lightning_fit.py, in-process, 2 steps each)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

from loading import load_example

# Checked without importing: the package loads only in the worker that runs these tests.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs lightning")


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("lightning_fit.py")


def _fit(example: ModuleType, *argv: str) -> tuple[list[float], Any, str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            losses, callback = example.main(list(argv))
    finally:
        torch.set_num_threads(threads)
    return losses, callback, out.getvalue()


@pytest.fixture(scope="module")
def baseline(example: ModuleType) -> list[float]:
    losses, callback, _ = _fit(example, "--no-remat")
    assert callback is None and len(losses) == 2
    return losses


@pytest.mark.parametrize(("module", "names"), [
    ("model", ["blocks.0", "blocks.1"]),
    ("", ["model.blocks.0", "model.blocks.1"]),  # the LightningModule itself
])
def test_strategy_is_applied_and_losses_are_unchanged(example: ModuleType, baseline: list[float],
                                                      module: str, names: list[str]) -> None:
    losses, callback, out = _fit(example, "--strategy", "full", f"--module={module}")
    assert callback.applied is not None and callback.applied.strategy == "full"
    assert [name for name, _ in callback.applied.decisions] == names
    assert callback.plan is None
    assert losses == pytest.approx(baseline, rel=1e-6, abs=0)
    assert "remat applied full" in out


def test_budget_plans_the_training_step_and_fits(example: ModuleType,
                                                 baseline: list[float]) -> None:
    import remat
    from remat.models import make_batch

    losses, callback, out = _fit(example, "--budget", "activations:70%")
    plan = callback.plan
    assert plan is not None and not plan.is_empty and callback.applied.strategy == "plan"
    assert plan.measured_peak_bytes <= plan.budget_bytes < plan.no_checkpoint_peak_bytes
    assert all(name.startswith("blocks.") for name in plan.decisions)  # relative to .model
    assert losses == pytest.approx(baseline, rel=1e-6, abs=0)
    # The planned step is training_step + backward + AdamW: the same bytes as profiling
    # the model itself with that optimizer (the step module adds nothing).
    lit = example.LitLM()
    batch = make_batch(lit.model, 4, 32, seed=1)
    optimizer = torch.optim.AdamW(lit.parameters(), lr=1e-3)
    none = remat.profile(lit.model, batch, optimizer=optimizer, timing=False)
    assert plan.no_checkpoint_peak_bytes == none.peak_bytes
    assert f"measured peak {plan.measured_peak_bytes:,} B" in out


def test_bad_arguments_are_refused(example: ModuleType) -> None:
    from remat.integrations.lightning import RematCallback

    with pytest.raises(ValueError, match="strategy or budget=, not both"):
        RematCallback("full", budget="1GiB")
    callback = RematCallback("full", module="encoder")
    with pytest.raises(ValueError, match=r"module='encoder' is not a submodule of LitLM"):
        callback.on_train_start(None, example.LitLM())
    callback = RematCallback("full", module=lambda lm: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="that is not inside LitLM"):
        callback.on_train_start(None, example.LitLM())


def test_a_pytorch_lightning_trainer_takes_the_callback(baseline: list[float]) -> None:
    """NOTE [ Both Lightning packages ]: the older package's Trainer accepts the callback
    and trains with it as lightning.pytorch's does."""
    from remat.integrations.lightning import RematCallback

    pl = pytest.importorskip("pytorch_lightning")
    import lightning.pytorch

    from remat.models import build_model, make_batch

    class OldLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build_model("gpt-tiny", dropout=0.0)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    lit = OldLM()
    data = make_batch(lit.model, 16, 32, seed=1)
    rows = [{key: value[i] for key, value in data.items()} for i in range(16)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    callback, log = RematCallback("full"), Losses()
    assert isinstance(callback, pl.Callback)
    assert isinstance(callback, lightning.pytorch.Callback)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, callbacks=[log, callback])
            trainer.fit(lit, loader)
    finally:
        torch.set_num_threads(threads)
    assert callback.applied is not None and callback.applied.strategy == "full"
    assert [name for name, _ in callback.applied.decisions] == ["model.blocks.0",
                                                                 "model.blocks.1"]
    assert log.losses == pytest.approx(baseline, rel=1e-6, abs=0)
