"""Every command on every model source: presets, --hf, --hf-config (file and directory) and
--module (the three factory shapes, a file path and a package module), tiny models, CPU.

NOTE [ Sampled source matrix ]
The sources resolve in remat/cli/sources.py, once per command and the same way for every
command: ``run_source`` for profile, compare and plan, ``model_choice`` for simulate and
estimate. Both read the Hugging Face config with ``hf_config`` and find a factory with
``load_factory``: the three Hugging Face sources differ only in how ``hf_config`` reads the
config (by name, from a file, from a folder), the two ``build_training`` sources only in
how ``load_factory`` finds the factory (a file path, a package module); what a command does
with the result depends on the kind of source alone: a preset, a Hugging Face config, or a
factory giving a model (remat's batches), a fixed batch, or ``make_batch`` and ``loss_fn``.
So ``profile`` (the in-process identity check, cheap) runs on all eight sources, every
variant's ``hf_config`` or ``load_factory`` included, and every other command on one source
of each kind, the variants spread over the commands: compare drops hf, hf-config-file and
module-object; plan drops hf-config-dir, and hf-config-file and module-object (the
plan-applies test plans those two and checks the same budget properties); simulate drops
hf, hf-config-dir and module-package; estimate drops hf-config-file, hf-config-dir and
module-object (and module-tuple, whose fixed batch it refuses:
test_a_fixed_batch_cannot_be_swept).
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import remat
from remat.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/my_model.py"
SIZES = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
         "max_position_embeddings": 128}
HF = ["--hf", "llama", *(a for k, v in SIZES.items() for a in ("--set", f"{k}={v}"))]


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run from the repository root (examples/ paths), with a package mypkg importable."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / EXAMPLE, tmp_path / "mypkg" / "zoo.py")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                                 **SIZES}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("REMAT_TEST_TMP", str(tmp_path))


def _sources() -> dict[str, list[str]]:
    import os

    tmp = os.environ["REMAT_TEST_TMP"]
    return {
        "preset": ["--model", "llama-tiny", "--set", "max_seq_len=64"],
        "hf": HF,
        "hf-config-file": ["--hf-config", f"{tmp}/llama/config.json"],
        "hf-config-dir": ["--hf-config", f"{tmp}/llama"],
        "module-model": ["--module", f"{EXAMPLE}:build"],
        "module-tuple": ["--module", f"{EXAMPLE}:build_with_batch"],
        "module-object": ["--module", f"{EXAMPLE}:build_training"],
        "module-package": ["--module", "mypkg.zoo:build_training"],
    }


SOURCES = ["preset", "hf", "hf-config-file", "hf-config-dir", "module-model", "module-tuple",
           "module-object", "module-package"]
#: One source of each kind per command (NOTE [ Sampled source matrix ]).
COMPARE_SOURCES = ["preset", "hf-config-dir", "module-model", "module-tuple", "module-package"]
PLAN_SOURCES = ["preset", "hf", "module-model", "module-tuple", "module-package"]
SIMULATE_SOURCES = ["preset", "hf-config-file", "module-model", "module-tuple", "module-object"]
ESTIMATE_SOURCES = ["preset", "hf", "module-model", "module-package"]
NAMES = {"preset": "llama-tiny", "hf": "hf:llama", "hf-config-file": "hf:llama",
         "hf-config-dir": "hf:llama", "module-model": f"module:{EXAMPLE}:build",
         "module-tuple": f"module:{EXAMPLE}:build_with_batch",
         "module-object": f"module:{EXAMPLE}:build_training",
         "module-package": "module:mypkg.zoo:build_training"}


def _invoke(args: list[str]) -> Any:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _in_process(source: str, batch_size: int, seq_len: int) -> tuple[Any, Any, Any]:
    """The model (seed 0), batch and loss_fn the CLI builds for ``source``, built here."""
    from remat.models import build_model, make_batch
    from remat.simulate.hf import hf_config_from_name, hf_model_from_config
    from remat.simulate.sim_setup import default_batch

    torch.manual_seed(0)
    if source == "preset":
        model = build_model("llama-tiny", max_seq_len=64)
        return model, make_batch(model, batch_size, seq_len), None
    if source.startswith("hf"):
        model = hf_model_from_config(hf_config_from_name("llama", **SIZES), device="cpu")
        return model, default_batch(model, batch_size, seq_len), None
    import mypkg.zoo as zoo

    if source == "module-model":
        model = zoo.build()
        return model, default_batch(model, batch_size, seq_len), None
    if source == "module-tuple":
        model, batch = zoo.build_with_batch()
        return model, batch, None
    made = zoo.build_training()
    return made.model, made.make_batch(batch_size, seq_len), made.loss_fn


#: The in-process model each source builds: the Hugging Face sources all build llama with
#: SIZES, the two ``build_training`` sources the same factory (see :func:`_in_process`).
_SAME_MODEL = {"hf-config-file": "hf", "hf-config-dir": "hf", "module-package": "module-object"}


@cache
def _expected(source: str, batch_size: int, seq_len: int) -> Any:
    """``remat.profile`` of :func:`_in_process`'s step: deterministic, so profiled once per
    model and shape for the profile and simulate tests."""
    key = _SAME_MODEL.get(source, source)
    if key != source:
        return _expected(key, batch_size, seq_len)
    model, batch, loss_fn = _in_process(source, batch_size, seq_len)
    return remat.profile(model, batch, loss_fn=loss_fn, timing=False)


@pytest.mark.parametrize("source", SOURCES)
def test_profile_gives_the_peak_of_remat_profile_on_the_same_model(source: str) -> None:
    data = _invoke(["profile", *_sources()[source], "--batch", "2", "--seq", "32",
                    "--repeats", "1", "--device", "cpu", "--json", "-"])
    assert data["model"] == NAMES[source]
    seq = 64 if source == "module-tuple" else 32  # a fixed batch keeps its own shape
    assert (data["batch_size"], data["seq_len"]) == (2, seq)
    expected = _expected(source, 2, seq)
    assert data["peak_bytes"] == expected.peak_bytes
    assert data["activation_bytes"] == expected.activation_bytes
    assert data["param_bytes"] == expected.param_bytes


@pytest.mark.parametrize("source", COMPARE_SOURCES)
def test_compare_checkpoints_every_source(source: str) -> None:
    data = _invoke(["compare", *_sources()[source], "--batch", "2", "--seq", "32",
                    "--strategies", "full", "--repeats", "0", "--plan-budget", "off",
                    "--device", "cpu", "--json", "-"])
    assert data["meta"]["model"] == NAMES[source]
    rows = {row["strategy"]: row for row in data["rows"]}
    assert set(rows) == {"none", "full"}
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["full"]["recompute_flops"] > 0
    assert rows["full"]["grad_passed"] is True


@pytest.mark.parametrize("source", PLAN_SOURCES)
def test_plan_fits_its_budget_on_every_source(source: str) -> None:
    data = _invoke(["plan", *_sources()[source], "--budget", "85%", "--batch", "2",
                    "--seq", "64", "--no-frontier", "--device", "cpu", "--json", "-"])
    _assert_plan_fits(data, source, 0.85)


def _assert_plan_fits(data: dict[str, Any], source: str, fraction: float) -> None:
    """``remat plan --json``'s output: the source's name, a plan within ``fraction`` of the
    step's peak without checkpointing, measured and by the allocator's accounting."""
    assert data["meta"]["model"] == NAMES[source]
    plan = data["plan"]
    assert plan["budget_bytes"] == int(fraction * plan["no_checkpoint_peak_bytes"])
    assert plan["measured_peak_bytes"] <= plan["budget_bytes"]
    assert plan["allocator_peak_bytes"] <= plan["budget_bytes"]


@pytest.mark.parametrize("source", ["module-object", "hf-config-file"])
def test_a_plan_applies_to_the_users_model_fits_and_keeps_gradients(
        source: str, tmp_path: Path) -> None:
    out, run = tmp_path / "plan.json", tmp_path / "run.json"
    result = runner.invoke(app, ["plan", *_sources()[source], "--budget", "70%", "--batch", "2",
                                 "--seq", "128", "--no-frontier", "--device", "cpu",
                                 "--out", str(out), "--json", str(run)])
    assert result.exit_code == 0, result.output
    assert f"remat plan: {NAMES[source]}, batch 2, seq 128" in result.stdout
    # these two sources are not in PLAN_SOURCES (NOTE [ Sampled source matrix ])
    _assert_plan_fits(json.loads(run.read_text()), source, 0.7)
    plan = remat.Plan.from_json(out.read_text())
    model, batch, loss_fn = _in_process(source, 2, 128)
    base = remat.profile(model, batch, loss_fn=loss_fn, timing=False).peak_bytes
    remat.apply(model, plan)
    peak = remat.profile(model, batch, loss_fn=loss_fn, timing=False).peak_bytes
    assert plan.budget_bytes == int(0.7 * base)
    assert peak <= plan.budget_bytes < base
    assert remat.validate(model, batch, plan, loss_fn=loss_fn).passed


@pytest.mark.parametrize("source", SIMULATE_SOURCES)
def test_simulate_every_source(source: str) -> None:
    batch = [] if source == "module-tuple" else ["--batch", "1,2"]
    data = _invoke(["simulate", *_sources()[source], "--seq", "32", *batch, "--strategies",
                    "none,full", "--dtype", "fp32", "--optimizer", "none", "--no-plan",
                    "--exact", "--json", "-"])
    assert data["model"] == NAMES[source]
    rows = {(row["strategy"], row["batch_size"]): row for row in data["rows"]}
    sizes = [2] if source == "module-tuple" else [1, 2]
    assert sorted(rows) == sorted((s, b) for s in ("none", "full") for b in sizes)
    # a simulated fp32 step allocates what the real CPU step does
    seq = 64 if source == "module-tuple" else 32
    assert rows["none", 2]["peak_bytes"] == _expected(source, 2, seq).peak_bytes
    assert rows["full", 2]["activation_bytes"] < rows["none", 2]["activation_bytes"]


def test_simulate_a_module_with_every_default_strategy_and_the_plan() -> None:
    from remat.strategies.registry import default_strategies

    data = _invoke(["simulate", "--module", f"{EXAMPLE}:build_training", "--seq", "32",
                    "--batch", "1", "--json", "-"])
    assert data["strategies"] == [*default_strategies("simulate"), "plan"]
    rows = {row["strategy"]: row for row in data["rows"]}
    assert rows["plan"]["peak_bytes"] <= rows["none"]["peak_bytes"]
    for name in ("full", "every:2", "sqrt", "attn", "mlp"):
        assert rows[name]["activation_bytes"] < rows["none"]["activation_bytes"], name


@pytest.mark.parametrize("source", ESTIMATE_SOURCES)
def test_estimate_every_source(source: str) -> None:
    data = _invoke(["estimate", *_sources()[source], "--seq", "16,32", "--batch", "1",
                    "--dtype", "fp32", "--json", "-"])
    assert data["model"] == NAMES[source]
    hf = source.startswith("hf")
    assert (data["hidden_size"], data["n_heads"], data["n_layers"]) == (32 if hf else 64, 4, 2)
    rows = {(r["seq_len"], r["checkpointing"]): r for r in data["rows"]}
    assert len(rows) == 4
    for seq in (16, 32):
        assert 0 < rows[seq, "full"]["simulated_bytes"] < rows[seq, "none"]["simulated_bytes"]
    assert rows[32, "none"]["simulated_bytes"] > rows[16, "none"]["simulated_bytes"]


# ---- the contract and bad input: exit 2 and what is wrong, never a traceback -------------

def _error(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.replace("│", " ").split())


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text("import torch\nfrom torch import nn\nfrom types import SimpleNamespace\n"
                    + text)
    return str(path)


BAD_FACTORIES: list[tuple[str, str, list[str]]] = [
    ("def build():\n    return nn.Linear(4, 4)\n",
     "build", ["remat plan: --module {path}:build returned a model but no batch",
               "fix: return (model, batch) or an object with make_batch(batch_size, seq_len)"]),
    ("def build():\n    return nn.Linear(4, 4), 1, 2\n",
     "build", ["returned a tuple of (Linear, int, int)", "(model, batch)"]),
    ("def build():\n    return 3\n", "build", ["returned a int", "SimpleNamespace("]),
    ("def build():\n    return SimpleNamespace(model=1)\n",
     "build", ["returned a SimpleNamespace whose .model is a int", "an nn.Module"]),
    ("def build():\n    return SimpleNamespace(model=nn.Linear(2, 2), make_batch=4)\n",
     "build", ["whose .make_batch is a int, not a function"]),
    ("def build():\n    raise ValueError('no weights here')\n",
     "build", ["calling the factory raised an error", "ValueError: no weights here",
               "user_model.py:5 in build"]),
    ("raise ImportError('cannot import shiny_lib')\n",
     "build", ["importing", "raised an error", "ImportError: cannot import shiny_lib"]),
    ("def make():\n    pass\nVALUE = 3\n",
     "build", ["has no 'build'", "callables defined there: make"]),
    ("VALUE = 3\n", "VALUE", ["'VALUE' is a int, not a function"]),
]


@pytest.mark.parametrize(("text", "factory", "expected"), BAD_FACTORIES)
def test_factories_that_break_the_contract_exit_2_saying_what(
        tmp_path: Path, text: str, factory: str, expected: list[str]) -> None:
    path = _write(tmp_path, text)
    output = _error(["plan", "--module", f"{path}:{factory}", "--device", "cpu"])
    for part in expected:
        assert part.format(path=path) in output


def test_bad_module_specs_exit_2() -> None:
    assert "cannot read --module 'my_model.py'" in _error(["profile", "--module", "my_model.py"])
    assert "no file 'nowhere/my_model.py'" in _error(
        ["profile", "--module", "nowhere/my_model.py:build"])
    assert "no module named 'no_such_pkg'" in _error(
        ["compare", "--module", "no_such_pkg.models:build"])
    assert "pass one of --model, --hf, --hf-config, --module (got --model, --module)" in _error(
        ["plan", "--model", "gpt-tiny", "--module", f"{EXAMPLE}:build"])
    assert "--set changes config fields" in _error(
        ["simulate", "--module", f"{EXAMPLE}:build", "--set", "n_layer=2"])
    assert "--module is not supported with --framework jax" in _error(
        ["compare", "--framework", "jax", "--module", f"{EXAMPLE}:build"])


def test_a_fixed_batch_cannot_be_swept() -> None:
    spec = f"{EXAMPLE}:build_with_batch"
    text = _error(["plan", "--module", spec, "--maximize", "throughput", "--device", "cpu"])
    assert f"remat plan: module:{spec} gives one fixed batch" in text
    assert "--maximize throughput searches batch sizes" in text
    text = _error(["simulate", "--module", spec, "--batch", "1,2,4"])
    assert "gives one fixed batch of 2; --batch asks for other sizes" in text
    assert "fix: return an object with make_batch(batch_size, seq_len)" in text
    text = _error(["estimate", "--module", spec])
    assert "estimate sweeps sequence lengths and batch sizes" in text


def test_a_fixed_batch_ignores_batch_and_seq_with_a_note() -> None:
    result = runner.invoke(app, ["profile", "--module", f"{EXAMPLE}:build_with_batch",
                                 "--batch", "8", "--seq", "16", "--repeats", "1",
                                 "--device", "cpu", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert "gives one fixed batch: --batch and --seq ignored" in result.stderr
    data = json.loads(result.stdout)
    assert (data["batch_size"], data["seq_len"]) == (2, 64)


def test_estimate_needs_readable_dimensions_and_points_to_simulate(tmp_path: Path) -> None:
    path = _write(tmp_path, "def build():\n    return SimpleNamespace(\n"
                            "        model=nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),\n"
                            "        make_batch=lambda b, s: torch.randn(b, 8))\n")
    text = _error(["estimate", "--module", f"{path}:build"])
    assert f"remat estimate: cannot read the dimensions of module:{path}:build's model" in text
    assert f"fix: run remat simulate --module {path}:build" in text


def test_a_factory_that_reads_values_cannot_be_simulated(tmp_path: Path) -> None:
    path = _write(tmp_path, "def build():\n    scale = torch.ones(1).item()\n"
                            "    return nn.Linear(4, 4), torch.randn(2, 4) * scale\n")
    text = _error(["simulate", "--module", f"{path}:build"])
    assert "the model cannot be simulated: calling the factory on the meta device" in text
    assert "user_model.py:5 in build" in text
    assert "remat profile / remat plan" in text
