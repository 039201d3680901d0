"""What a gradient-parity check returns, in either backend.

``remat.validate`` (PyTorch, ``remat.validation.parity``) and ``remat.jax.validate``
run one step without checkpointing and one with the strategy, on the same weights,
inputs and RNG seed, and compare the loss and every parameter gradient. Both report
the comparison as a :class:`ParityReport`; it holds numbers only, so it lives here,
free of either framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from remat.errors import ParityError, message


@dataclass(frozen=True)
class ParityReport:
    """Loss and gradients of a strategy compared with the un-checkpointed model.

    Args:
        strategy: the strategy (or ``"plan"``) that was checked.
        loss_ref: loss without checkpointing.
        loss: loss with the strategy.
        loss_rel_error: ``|loss - loss_ref| / |loss_ref|``.
        max_rel_error: the worst relative error over the loss and all gradients.
        worst_param: name of the parameter with the worst gradient error.
        per_param_rel_error: per parameter, ``max|g - g_ref| / max|g_ref|``.
        rtol: the tolerance ``passed`` uses. Default: ``1e-6``.
    """

    strategy: str
    loss_ref: float
    loss: float
    loss_rel_error: float
    max_rel_error: float
    worst_param: str
    per_param_rel_error: dict[str, float] = field(default_factory=dict)
    rtol: float = 1e-6

    def __post_init__(self) -> None:
        if not self.rtol > 0:
            raise ValueError(message("ParityReport", "rtol must be > 0",
                                     {"found": repr(self.rtol)}, fix="pass rtol > 0"))

    @property
    def passed(self) -> bool:
        """Whether loss and every gradient match within ``rtol``."""
        return self.max_rel_error <= self.rtol

    def raise_if_failed(self) -> None:
        """Raise :class:`~remat.errors.ParityError` when the check failed."""
        if not self.passed:
            raise ParityError(message(
                "remat.validate", f"strategy {self.strategy!r} changes gradients",
                {"worst relative error": f"{self.max_rel_error:.3g} (parameter "
                                         f"{self.worst_param!r}) > rtol {self.rtol:.1g}",
                 "loss": f"{self.loss:.8g} vs {self.loss_ref:.8g}"},
                fix="check for randomness outside torch's RNG or state updated in forward "
                    "(see pitfall warnings from remat.apply)"))
