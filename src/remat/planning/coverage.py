"""Whether the blocks found hold the step's activations, and where they are when not.

NOTE [ Blocks that miss the activations ]
    Checkpointing frees only what the blocks keep for backward. Block finding is
    structural (NOTE [ Default block detection ] in remat/blocks.py), so a model whose
    activations live elsewhere (a CNN's stem, a large output head, a tower held by no
    container) gets blocks that hold little of them, and a plan or ``"full"`` on them
    lowers the peak by little: a silent no-op unless said. The planner's windows step
    knows each block's share of the activation bytes (the tracker's
    ``block_saved_bytes``), and the bytes the forward had made by the end of the last
    block (the last gap window's start less the step's start): what comes after is the
    output head and loss, which the planner chunks (NOTE [ Head choice ] in head.py), so
    those bytes are not the blocks' to hold. Where the blocks hold less than
    :data:`MIN_SHARE` of the bytes made up to the last block's end, one
    more tracked step attributes every saved byte to the module that made it (every
    module a "block" of the tracker, the innermost one wins), each module outside the
    blocks is counted under its outermost ancestor that holds no block, and a
    :class:`~remat.errors.RematWarning` names the largest of them with the fix
    (``blocks=`` naming them). Bytes no module made (the model's own forward code: a loss
    computed inline) are named as such. The extra step runs only when the warning is
    given.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from remat.errors import RematWarning, message
from remat.measure.step import Step, clear_grads
from remat.measure.tracked_step import tracked_step
from remat.measure.windows import FakeSetup, StepWindows
from remat.strategies.apply import quiet_warnings
from remat.units import format_bytes

#: Below this share of the step's activation bytes in the blocks, the planner says so.
MIN_SHARE = 0.5
_OUTSIDE = "the model's own forward (no submodule)"


def warn_uncovered(step: Step, setup: FakeSetup, windows: StepWindows, *,
                   api: str = "remat.plan") -> None:
    """Warn when ``setup``'s blocks hold less than :data:`MIN_SHARE` of the activation
    bytes of ``windows``' step, naming where the rest are (NOTE [ Blocks that miss the
    activations ])."""
    total = windows.activation_bytes
    last_gap = f"gap:{len(setup.blocks) - 1}"
    if last_gap in windows.starts and "pre" in windows.starts:
        total = min(total, windows.starts[last_gap] - windows.starts["pre"])
    in_blocks = sum(windows.block_saved.values())
    if total <= 0 or in_blocks >= MIN_SHARE * total:
        return
    owners = activation_owners(step, setup)
    shown = ", ".join(f"{name} {format_bytes(b)}" for name, b in owners[:3]) or "unknown"
    stacks = sorted({name.rpartition(".")[0] or name for name, _ in setup.blocks})
    warnings.warn(message(
        api, f"the blocks found hold {100 * in_blocks / total:.0f}% of the activation bytes "
        "made before the output head, so checkpointing them frees at most that",
        {"blocks": f"{len(setup.blocks)} in {', '.join(stacks)}",
         "activations": f"{format_bytes(total)} made up to the last block's end",
         "most of the rest is in": shown},
        fix="pass blocks= selecting the modules that hold them too (a predicate "
            "blocks=lambda name, module: ...), or plan a smaller batch or sequence"),
        RematWarning, stacklevel=5)


def activation_owners(step: Step, setup: FakeSetup) -> list[tuple[str, int]]:
    """Activation bytes outside ``setup``'s blocks, per outermost module holding no block,
    largest first, from one tracked step of ``setup``'s copy."""
    model = setup.model
    every = [(name, module) for name, module in model.named_modules() if name]
    fstep = step.with_model(model, setup.optimizer, setup.batch)
    with quiet_warnings(), setup.mode:
        clear_grads(model)
        try:
            tracked = tracked_step(fstep, every)
        finally:
            clear_grads(model)  # the copy as the closed loop expects it
    saved = tracked.tracker.block_saved_bytes
    outside = tracked.tracker.activation_bytes - sum(saved.values())
    return owners_outside(saved, [name for name, _ in setup.blocks], outside)


def owners_outside(saved: Mapping[str, int], blocks: Sequence[str],
                   unattributed: int = 0) -> list[tuple[str, int]]:
    """``saved`` bytes per module, those inside ``blocks`` dropped and the others summed
    under their outermost ancestor that contains no block; ``unattributed`` bytes under
    the model's own forward; largest first.

    Example:
        >>> owners_outside({"stem.conv": 8, "layers.0.fc": 4, "head": 2}, ["layers.0"])
        [('stem', 8), ('head', 2)]
    """
    def inside(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in blocks)

    def holds_block(prefix: str) -> bool:
        return any(b == prefix or b.startswith(prefix + ".") for b in blocks)

    totals: dict[str, int] = {}
    for name, nbytes in saved.items():
        if nbytes <= 0 or inside(name):
            continue
        parts = name.split(".")
        owner = next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                      if not holds_block(".".join(parts[:i]))), name)
        totals[owner] = totals.get(owner, 0) + nbytes
    if unattributed > 0:
        totals[_OUTSIDE] = totals.get(_OUTSIDE, 0) + unattributed
    return sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))
