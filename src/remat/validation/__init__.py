"""Validation: gradient parity against the un-checkpointed model.

The pitfall checks that run when a strategy is applied live with the strategies
(:mod:`remat.strategies.pitfalls`); :func:`remat.validate` compares the loss and every
parameter gradient of a checkpointed step with the un-checkpointed one, and returns a
:class:`remat.core.parity.ParityReport` (shared with the JAX backend).
"""

from remat.validation.parity import relative_error, validate

__all__ = ["relative_error", "validate"]
