"""benchmarks/planner.py's held-out set stays held out: no planning test builds its families."""

from __future__ import annotations

import re

from loading import ROOT, load_module

_PLANNER = load_module(ROOT / "benchmarks" / "planner.py", "remat_planner_benchmark")


def _spellings(family: str) -> set[str]:
    """``qwen3_moe`` as tests write it: ``qwen3_moe``, ``qwen3-moe``, ``qwen3moe``."""
    return {family, family.replace("_", "-"), re.sub(r"[_-]", "", family)}


def test_no_planning_test_uses_a_held_out_family() -> None:
    families = {s for f in _PLANNER.HELD_OUT_FAMILIES for s in _spellings(f)}
    found = []
    used = [*sorted((ROOT / "tests" / "planning").rglob("*.py")),
            ROOT / "tests" / "generated_models.py"]  # the planning tests' random decoders
    for path in used:
        # Compare without separators so "Qwen3Moe", "qwen3_moe" and "gpt-j" all match.
        text = re.sub(r"[_-]", "", path.read_text().lower())
        found += [(path.name, f) for f in families if re.sub(r"[_-]", "", f) in text]
    assert not found, f"held-out families in tests/planning (tune on them elsewhere): {found}"


def test_every_held_out_run_has_a_family_and_a_shape_in_range() -> None:
    names = [name for name, _ in _PLANNER.HELD_OUT_RUNS]
    assert len(names) >= 5
    flat = {re.sub(r"[_-]", "", f) for f in _PLANNER.HELD_OUT_FAMILIES}
    for name in names:
        assert re.sub(r"[_-]", "", name.removeprefix("ho-")) in flat, name
        layers, hidden, seq = _PLANNER.HELD_OUT_SHAPES[name]
        assert 2 <= layers <= 6 and 64 <= hidden <= 128 and 64 <= seq <= 128, name



def test_the_families_set_adds_families_nothing_else_uses() -> None:
    """``--models families``: at least 8 families, the added ones used by no planning test,
    no generated draw and no other set of benchmarks/planner.py."""
    names = [name.removeprefix("fam-") for name, _ in _PLANNER.FAMILY_RUNS]
    assert len(set(names)) >= 8
    flat = {re.sub(r"[_-]", "", n) for n in names}
    added = {s for f in _PLANNER.FAMILY_HELD_OUT for s in _spellings(f)}
    assert {re.sub(r"[_-]", "", f) for f in added} <= flat
    others = [name for runs in (_PLANNER.RUNS, _PLANNER.HF_RUNS, _PLANNER.HF_MORE_RUNS,
                                _PLANNER.HELD_OUT_RUNS) for name, _ in runs]
    assert not [n for n in others if re.sub(r"[_-]", "", n.split("-", 1)[1]) in
                {re.sub(r"[_-]", "", f) for f in added}]
    found = []
    used = [*sorted((ROOT / "tests" / "planning").rglob("*.py")),
            ROOT / "tests" / "generated_models.py"]
    for path in used:
        text = re.sub(r"[_-]", "", path.read_text().lower())
        found += [(path.name, f) for f in added if re.sub(r"[_-]", "", f) in text]
    assert not found, f"added families in tests/planning: {found}"


def _identifiers(text: str) -> set[str]:
    """Every name in ``text``, lower case, without ``_`` and ``-``."""
    return {re.sub(r"[_-]", "", word.lower())
            for word in re.findall(r"[A-Za-z_][A-Za-z0-9_-]*", text)}


def test_the_architectures_set_is_built_from_names_nothing_else_uses() -> None:
    """``--models architectures``: at least 8 families, each only a ``model_type`` (no
    builder per family), none that a planning test, a generated draw or another set uses
    (a name such as ``MptConfig`` or ``"gpt_oss"`` counts; ``empty`` is not ``mpt``)."""
    types = _PLANNER.ARCH_TYPES
    assert len(set(types)) == len(types) >= 8
    flat = {re.sub(r"[_-]", "", t) for t in types}
    others = [name.split("-", 1)[1] for runs in (
        _PLANNER.RUNS, _PLANNER.HF_RUNS, _PLANNER.HF_MORE_RUNS, _PLANNER.HELD_OUT_RUNS,
        _PLANNER.FAMILY_RUNS) for name, _ in runs]
    taken = {re.sub(r"[_-]", "", n) for n in (*others, *_PLANNER.HELD_OUT_FAMILIES)}
    assert not flat & taken
    found = []
    used = [*sorted((ROOT / "tests" / "planning").rglob("*.py")),
            ROOT / "tests" / "generated_models.py"]
    for path in used:
        names = _identifiers(path.read_text())
        found += [(path.name, t) for t in flat if any(n.startswith(t) for n in names)]
    assert not found, f"architectures-set families in tests/planning: {found}"
    assert [f"arch-{t}" for t in types] == [n for n, _ in _PLANNER.ARCH_RUNS]
