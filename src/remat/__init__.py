"""remat: trade compute for memory in PyTorch training.

Give remat a model, a batch and a budget in bytes; get a checkpointing plan that
fits, costs the least recompute, and leaves gradients unchanged::

    import remat
    from remat.models import build_model, make_batch

    model = build_model("gpt-small")
    batch = make_batch(model, 8)
    print(remat.profile(model, batch).peak_bytes)      # exact bytes of one step
    plan = remat.auto(model, batch, budget="60%")      # plan, apply, measure
    assert remat.validate(model, batch, plan).passed   # gradients unchanged

Importing remat has no side effects: it does not initialize CUDA, and plotting
and Hugging Face libraries load only when used.

NOTE [ Eager public names ]
    ``validate`` and ``plan`` are both functions here and subpackages
    (``remat.validate``, ``remat.plan``). Importing a subpackage binds its name on
    this package, so the functions are imported eagerly below, after the
    subpackages: the later binding (the function) is the one that stays.
"""

from remat.blocks import find_blocks
from remat.errors import (
    BlocksNotFound,
    BudgetTooSmall,
    ParityError,
    RematError,
    RematWarning,
    StrategyError,
)
from remat.measure import Profile, profile
from remat.plan import Plan, auto, plan
from remat.strategies.apply import apply, remove
from remat.strategies.context import is_recomputing
from remat.strategies.spec import STRATEGIES, BlockDecision
from remat.units import format_bytes, parse_bytes
from remat.validate.parity import ParityReport, validate

__version__ = "0.1.0"

__all__ = [
    "BlockDecision",
    "BlocksNotFound",
    "BudgetTooSmall",
    "ParityError",
    "ParityReport",
    "Plan",
    "Profile",
    "RematError",
    "RematWarning",
    "STRATEGIES",
    "StrategyError",
    "apply",
    "auto",
    "find_blocks",
    "format_bytes",
    "is_recomputing",
    "parse_bytes",
    "plan",
    "profile",
    "remove",
    "validate",
]
