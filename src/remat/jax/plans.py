"""The JAX :class:`Plan`: a ``jax.checkpoint`` policy per block, with its XLA-measured cost.

NOTE [ JAX plan JSON ]
    ``{"format": "remat.plan", "version": 1, "framework": "jax", ...}``: the envelope
    every plan file has (NOTE [ Plan file envelope ] in remat/core/plan_file.py), then
    the policy per block by its label. :meth:`Plan.from_json` refuses a PyTorch plan
    (no ``framework``, or ``"torch"``) with a message naming ``remat.Plan.from_json``,
    and versions it does not know.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from remat.core.checks import check_int, decisions_label, opt_int
from remat.core.plan_file import envelope, load_json, read_envelope
from remat.errors import message, one_line
from remat.jax.policies import Policy, parse_policy
from remat.units import format_bytes

JAX_PLAN_VERSION = 1
_FRAMEWORK = "jax"
_OWNER = "remat.jax.Plan"


@dataclass(frozen=True)
class Plan:
    """A ``jax.checkpoint`` policy per block, and what XLA says it costs.

    Made by :func:`remat.jax.plan`, applied with ``remat.jax.apply(model, plan)``.
    Blocks not in ``decisions`` run without checkpoint.

    Args:
        decisions: per block path, its :class:`~remat.jax.Policy` (``"none"`` dropped).
        block_names: every block path, in forward order.
        budget_bytes: the peak budget the plan was made for, bytes.
        predicted_peak_bytes: the peak model's prediction, bytes.
        measured_peak_bytes: XLA's compiled peak of the step with the plan applied
            (arguments + outputs + temporaries - aliased); None until measured.
        recompute_flops: extra FLOPs of the step (XLA ``cost_analysis``) against the
            un-checkpointed step.
        no_checkpoint_peak_bytes: XLA's peak of the un-checkpointed step. Default: None.
        batch_size: samples per step. Default: None.
        backend: the XLA backend measured on, e.g. ``"cpu"``. Default: ``"cpu"``.
        framework: always ``"jax"``.

    Example:
        >>> p = remat.jax.plan(model, batch, budget="50%")
        >>> Plan.from_json(p.to_json()) == p
        True
    """

    decisions: Mapping[str, Policy]
    block_names: tuple[str, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int | None = None
    recompute_flops: int = 0
    no_checkpoint_peak_bytes: int | None = None
    batch_size: int | None = None
    backend: str = "cpu"
    framework: str = field(default=_FRAMEWORK)

    def __post_init__(self) -> None:
        names = tuple(self.block_names)
        object.__setattr__(self, "block_names", names)
        if len(set(names)) != len(names):
            raise ValueError(message("remat.jax.Plan", "block_names has duplicates",
                                     {"block_names": sorted(names)},
                                     fix="name each block once"))
        if self.framework != _FRAMEWORK:
            raise ValueError(message("remat.jax.Plan", "framework must be 'jax'",
                                     {"framework": repr(self.framework)},
                                     fix="load a PyTorch plan with remat.Plan.load"))
        decisions: dict[str, Policy] = {}
        for name, policy in dict(self.decisions).items():
            if name not in names:
                raise ValueError(message(
                    "remat.jax.Plan", f"a decision for {name!r}, which is not a block",
                    {"block_names": ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")},
                    fix="decide only for block_names"))
            p = parse_policy(policy)
            if not p.is_none:
                decisions[name] = p
        ordered = {n: decisions[n] for n in names if n in decisions}
        object.__setattr__(self, "decisions", MappingProxyType(ordered))
        for key in ("budget_bytes", "predicted_peak_bytes", "recompute_flops"):
            check_int(_OWNER, key, getattr(self, key))
        for key in ("measured_peak_bytes", "no_checkpoint_peak_bytes", "batch_size"):
            check_int(_OWNER, key, getattr(self, key), optional=True)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def decision(self, name: str) -> Policy:
        """The policy of block ``name`` (``none`` when the plan leaves it alone)."""
        if name not in self.block_names:
            raise KeyError(one_line(message("remat.jax.Plan.decision", f"no block {name!r}",
                                            {"blocks": ", ".join(self.block_names[:6])},
                                            fix="pass one of the plan's block_names")))
        return self.decisions.get(name, Policy("none"))

    @property
    def is_empty(self) -> bool:
        """True when no block is checkpointed."""
        return not self.decisions

    @property
    def peak_bytes(self) -> int:
        """The measured peak when known, else the predicted one."""
        return self.measured_peak_bytes if self.measured_peak_bytes is not None \
            else self.predicted_peak_bytes

    def label(self) -> str:
        """Policy counts in block order of first use, e.g. ``"4 none, 2 dots_saveable"``."""
        return decisions_label(self.decision(name).label() for name in self.block_names)

    def summary(self) -> str:
        """Plain text: budget, peaks, recompute FLOPs and the policy per block."""
        def fmt(value: int | None) -> str:
            return "-" if value is None else format_bytes(value)

        lines = [
            f"remat.jax plan ({self.backend}): {self.label()}",
            f"  budget            {fmt(self.budget_bytes)}",
            f"  peak (XLA)        {fmt(self.measured_peak_bytes)}",
            f"  peak (predicted)  {fmt(self.predicted_peak_bytes)}",
            f"  no-remat peak     {fmt(self.no_checkpoint_peak_bytes)}",
            f"  recompute         {self.recompute_flops / 1e9:.3f} GFLOP/step (XLA)",
        ]
        lines += [f"  {n:<16}  {self.decision(n).label()}" for n in self.block_names]
        return "\n".join(lines)

    # ---- JSON (NOTE [ JAX plan JSON ]) -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            **envelope(_FRAMEWORK, JAX_PLAN_VERSION),
            "block_names": list(self.block_names),
            "decisions": {n: p.label() for n, p in self.decisions.items()},
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "recompute_flops": self.recompute_flops,
            "no_checkpoint_peak_bytes": self.no_checkpoint_peak_bytes,
            "batch_size": self.batch_size,
            "backend": self.backend,
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as JSON text; read back with :meth:`from_json`."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan written by :meth:`to_dict`.

        Raises:
            ValueError: not a remat plan, a PyTorch plan, or an unknown version.
        """
        read_envelope(data, framework=_FRAMEWORK, versions=(JAX_PLAN_VERSION,),
                      api="remat.jax.Plan.from_json", make="remat.jax.plan(...)")
        try:
            return cls(
                decisions={str(n): parse_policy(str(p))
                           for n, p in dict(data.get("decisions") or {}).items()},
                block_names=tuple(str(n) for n in data["block_names"]),
                budget_bytes=int(data["budget_bytes"]),
                predicted_peak_bytes=int(data["predicted_peak_bytes"]),
                measured_peak_bytes=opt_int(data.get("measured_peak_bytes")),
                recompute_flops=int(data.get("recompute_flops", 0)),
                no_checkpoint_peak_bytes=opt_int(data.get("no_checkpoint_peak_bytes")),
                batch_size=opt_int(data.get("batch_size")),
                backend=str(data.get("backend", "cpu")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(message("remat.jax.Plan.from_json", "malformed plan",
                                     {"error": f"{type(exc).__name__}: {exc}"},
                                     fix="load a file written by Plan.save")) from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json` (see :meth:`from_dict` for errors)."""
        return cls.from_dict(load_json(text, api="remat.jax.Plan.from_json"))
