"""One word per idea, checked: the glossary in docs/architecture.md lists each word once,
and a public name built on a glossary word is one of the names the glossary gives that
word (or an allowed exception, with the reason).

"Public" is what a user can import: ``remat.__all__`` and the ``__all__`` of every public
module (tests/test_layers.py's ``PUBLIC_LEAVES`` and the package ``__init__`` files).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from test_layers import PUBLIC_LEAVES, SRC

ROOT = Path(__file__).resolve().parents[1]

#: The words whose meanings drifted before; each public name holding one is checked.
CHECKED = ("chunk", "budget", "plan", "cost", "candidate", "window", "region", "offer")

#: Public names built on a checked word that are not in its glossary row, and why.
ALLOWED = {
    "PLAN_FORMAT_VERSION": "the plan file's format version: a plan's, as the word means",
    "PlanContext": "what planning one step measures once: a plan's inputs",
    "PlanOptions": "the options of one remat.plan call",
    "RankPlan": "a pipeline rank's plans, one per chunk (glossary: stage)",
    "plan": "remat.plan, the planner itself",
    "plan_compiled": "the planner for compiled steps",
    "plan_rank": "the planner of a pipeline rank (glossary: stage)",
    "plan_stage": "the planner of a pipeline stage (glossary: stage)",
    "plan_step": "the planner of a Step",
    "plan_seq_len": "the planner of the longest sequence",
    "plan_throughput": "the planner of the batch size",
    "plan_renderable": "a plan as a rich table",
    "plan_text": "a plan as text",
    "plan_preset": "remat.jax's planner of a built-in preset",
    "tp_plan": "the glossary's TP plan (its own row)",
    "ShapeOutsidePlan": "the error: a batch outside the shapes a plan was made for",
    "BudgetTooSmall": "the error: no plan fits the budget",
    "CardBudget": "a budget of the card kind (glossary: card)",
    "card_budget": "a budget of the card kind (glossary: card)",
    "single_device_budget_bytes": "a budget in bytes, as the word means",
    "StepCost": "a step's cost: the glossary's cost of a candidate is made of it",
    "ChunkBytes": "a pipeline rank's chunk (glossary: stage)",
    "held_by_chunk": "a pipeline rank's chunk (glossary: stage)",
}


def _glossary() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Glossary", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        match = re.match(r"\| \*\*(.+?)\*\*(?: / \*\*(.+?)\*\*)? \|", line)
        if match:
            for word in filter(None, match.groups()):
                rows.append((word, line))
    return rows


def _public_names() -> dict[str, str]:
    modules = ["remat", *PUBLIC_LEAVES]
    modules += ["remat." + ".".join(p.relative_to(SRC).parts[:-1])
                for p in SRC.rglob("__init__.py") if p.parent != SRC]
    names: dict[str, str] = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra (jax) not installed
            continue
        for public in getattr(module, "__all__", ()):
            names.setdefault(public, name)
    return names


def _words(name: str) -> set[str]:
    return set(re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower().split("_"))


def test_each_glossary_word_is_listed_once() -> None:
    words = [word for word, _ in _glossary()]
    assert len(words) > 20
    assert sorted(w for w in set(words) if words.count(w) > 1) == []


def test_public_names_on_a_glossary_word_mean_that_word() -> None:
    rows = _glossary()
    names = _public_names()
    assert len(names) > 100
    drifted = []
    for word in CHECKED:
        listed = " ".join(line for w, line in rows if word in w.split())
        for name, module in sorted(names.items()):
            if word in _words(name) and f"`{name}" not in listed and name not in ALLOWED:
                drifted.append(f"{module}.{name} holds {word!r}")
    assert drifted == [], (
        "public names on a glossary word that its glossary row does not list (add them "
        "there, rename them, or allow them here with the reason):\n" + "\n".join(drifted))
