"""Validation: gradient parity against the un-checkpointed model, and pitfall checks."""

from remat.validate.parity import ParityReport, relative_error, validate
from remat.validate.pitfalls import Pitfall, check_model, check_regions, warn_pitfalls

__all__ = [
    "ParityReport",
    "Pitfall",
    "check_model",
    "check_regions",
    "relative_error",
    "validate",
    "warn_pitfalls",
]
