"""Measure a training step exactly: bytes per storage, FLOPs per op, times per phase and block.

Example::

    >>> from remat.measure import profile
    >>> from remat.models import build_model, make_batch
    >>> model = build_model("gpt-tiny")
    >>> prof = profile(model, make_batch(model, 2), timing=False)
    >>> prof.peak_bytes >= prof.param_bytes + prof.activation_bytes
    True
"""

from __future__ import annotations

from remat.core.op_record import OpRecord
from remat.core.results import BlockProfile, Profile, SavedStorage
from remat.measure.fake import fake_copy
from remat.measure.profile import profile, profile_simulated
from remat.measure.reserved import reserved_of_step
from remat.measure.roofline import roofline_ms
from remat.measure.saved import saved_storages
from remat.measure.step import run_step
from remat.measure.tracker import MemoryTracker

__all__ = [
    "BlockProfile",
    "MemoryTracker",
    "OpRecord",
    "Profile",
    "SavedStorage",
    "fake_copy",
    "profile",
    "profile_simulated",
    "reserved_of_step",
    "roofline_ms",
    "run_step",
    "saved_storages",
]
