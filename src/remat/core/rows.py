"""What a comparison returns: one row per strategy, and the whole table with its JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from remat.core.cost import CostViews, StepCost
from remat.errors import message, one_line

#: The strategy every row is compared with.
BASELINE = "none"
_BASELINE = BASELINE
_JSON_VERSION = 1


#: The cost fields a row writes to JSON, in this order (NOTE: kept flat, as before
#: ``StrategyRow.cost``, so comparison files read both ways).
_COST_KEYS = ("peak_bytes", "activation_bytes", "param_bytes", "grad_bytes", "flops",
              "recompute_flops", "step_ms")


@dataclass(frozen=True)
class StrategyRow(CostViews):
    """One strategy's measurements and its comparison with the ``"none"`` baseline.

    Args:
        strategy: the strategy string, e.g. ``"every:2"``.
        cost: the step's :class:`~remat.core.cost.StepCost` as a row records it:
            ``peak_bytes`` (peak memory of one training step, params, grads, batch and
            activations included), ``activation_bytes`` (bytes created in forward and
            still alive when backward starts), ``param_bytes``, ``grad_bytes``,
            ``flops`` (forward + backward FLOPs, recomputation included; the
            forward/backward split is not kept), ``recompute_flops`` (FLOPs of the
            recompute passes) and ``step_ms`` (median forward+backward wall time in ms;
            ``None`` when not timed). The flat names below are read-only views of it.
        peak_change_pct: ``100 * (peak / peak_none - 1)``; negative saves memory.
        activation_change_pct: the same for ``activation_bytes``.
        recompute_overhead_pct: ``100 * recompute_flops / flops_none``.
        step_time_ratio: ``step_ms / step_ms_none``; ``None`` when not timed.
        grad_max_rel_error: worst relative gradient (or loss) error against the
            un-checkpointed model; ``None`` when validation was skipped.
        grad_passed: whether that error is within tolerance; ``None`` when skipped.
        worst_param: the parameter with the worst error; ``None`` when skipped.
        allocator_peak_bytes: the allocator's peak (``Profile.allocator_peak_bytes``),
            else ``None``.
    """

    strategy: str
    cost: StepCost
    peak_change_pct: float
    activation_change_pct: float
    recompute_overhead_pct: float
    step_time_ratio: float | None
    grad_max_rel_error: float | None = None
    grad_passed: bool | None = None
    worst_param: str | None = None
    allocator_peak_bytes: int | None = None

    @classmethod
    def from_profile(cls, strategy: str, prof: Any, base: Any, *, step_ms: float | None = None,
                     base_ms: float | None = None, report: Any = None) -> StrategyRow:
        """A row from a Profile, the ``none`` baseline's Profile and an optional ParityReport."""
        return cls(
            strategy=strategy,
            cost=StepCost(
                peak_bytes=int(prof.peak_bytes),
                activation_bytes=int(prof.activation_bytes),
                param_bytes=int(prof.param_bytes),
                grad_bytes=int(prof.grad_bytes),
                flops=int(prof.flops),
                recompute_flops=int(prof.recompute_flops),
                step_ms=step_ms,
            ),
            peak_change_pct=_change_pct(prof.peak_bytes, base.peak_bytes),
            activation_change_pct=_change_pct(prof.activation_bytes, base.activation_bytes),
            recompute_overhead_pct=100.0 * prof.recompute_flops / max(base.flops, 1),
            step_time_ratio=(step_ms / base_ms) if step_ms is not None and base_ms else None,
            grad_max_rel_error=_report_error(report),
            grad_passed=None if report is None else bool(report.passed),
            worst_param=None if report is None else str(report.worst_param),
            allocator_peak_bytes=getattr(prof, "allocator_peak_bytes", None),
        )

    def __post_init__(self) -> None:
        if not self.strategy:
            raise ValueError(message("StrategyRow", "strategy must be a non-empty string",
                                     fix="pass the strategy's name, e.g. 'every:2'"))
        if not isinstance(self.cost, StepCost) or self.cost.flops is None:
            raise ValueError(message(f"StrategyRow({self.strategy!r})",
                                     "cost must be a StepCost with flops",
                                     {"found": repr(self.cost)},
                                     fix="build it with StepCost(peak_bytes=..., flops=..., ...)"))
        for name in ("step_time_ratio", "grad_max_rel_error"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(message(f"StrategyRow({self.strategy!r})",
                                         f"{name} must be a finite number >= 0 or None",
                                         {"found": repr(value)},
                                         fix=f"pass {name} >= 0 or None"))
        if (self.grad_passed is None) != (self.grad_max_rel_error is None):
            raise ValueError(message(
                f"StrategyRow({self.strategy!r})",
                "grad_passed and grad_max_rel_error must both be set or both be None",
                {"grad_passed": repr(self.grad_passed),
                 "grad_max_rel_error": repr(self.grad_max_rel_error)},
                fix="set both (a gradient check ran) or neither"))

    # ---- views of cost (read-only; the figures live in ``cost``) -------------------------

    @property
    def step_ms(self) -> float | None:
        """``cost.step_ms``: median step time, ms; ``None`` when not timed."""
        return self.cost.step_ms

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-able data, cost fields flat (the comparison JSON's row format)."""
        out: dict[str, Any] = {"strategy": self.strategy}
        out.update({key: getattr(self, key) for key in _COST_KEYS})
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in ("strategy", "cost")})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StrategyRow:
        """Rebuild a row written by :meth:`to_dict` (flat cost fields)."""
        rest = {k: v for k, v in data.items() if k not in _COST_KEYS}
        return cls(**rest, cost=StepCost(**{k: data[k] for k in _COST_KEYS}))


@dataclass(frozen=True)
class ComparisonResult:
    """Every strategy's :class:`StrategyRow`, baseline (``"none"``) first.

    Args:
        rows: one row per strategy, in the order they were requested.
        device: the device the steps ran on, e.g. ``"cpu"`` or ``"cuda:0"``.
        repeats: timed steps per strategy (0: timing skipped).
        label: free text naming the setup, e.g. ``"gpt-small, batch 8, seq 256"``.
        baseline: the strategy the changes are relative to. Default: ``"none"``.
        meta: extra JSON-able facts about the run (model preset, batch size, ...).
    """

    rows: tuple[StrategyRow, ...]
    device: str
    repeats: int
    label: str = ""
    baseline: str = _BASELINE
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError(message("ComparisonResult", "rows must not be empty",
                                     fix="pass one row per strategy"))
        names = [row.strategy for row in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(message("ComparisonResult", "duplicate strategies",
                                     {"strategies": names}, fix="pass one row per strategy"))
        if self.baseline not in names:
            raise ValueError(message("ComparisonResult",
                                     f"baseline {self.baseline!r} is not among the rows",
                                     {"rows": names}, fix="include the baseline's row"))
        if self.repeats < 0:
            raise ValueError(message("ComparisonResult", "repeats must be >= 0",
                                     {"found": self.repeats}, fix="pass repeats >= 0"))

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategy names, in row order."""
        return tuple(row.strategy for row in self.rows)

    def row(self, strategy: str) -> StrategyRow:
        """The row of ``strategy``; raises ``KeyError`` listing the known ones."""
        for row in self.rows:
            if row.strategy == strategy:
                return row
        raise KeyError(one_line(message("ComparisonResult.row", f"no strategy {strategy!r}",
                                        {"have": list(self.strategies)},
                                        fix="ask for a strategy the comparison measured")))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with keys version, label, device, repeats, baseline, meta, rows."""
        return {
            "version": _JSON_VERSION,
            "label": self.label,
            "device": self.device,
            "repeats": self.repeats,
            "baseline": self.baseline,
            "meta": dict(self.meta),
            "rows": [row.to_dict() for row in self.rows],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ComparisonResult:
        """Rebuild a result written by :meth:`to_dict` (validates it again)."""
        version = data.get("version")
        if version != _JSON_VERSION:
            raise ValueError(message("ComparisonResult.from_dict",
                                     f"unsupported version {version!r}",
                                     {"this remat reads version": _JSON_VERSION},
                                     fix="re-run the comparison with this remat version"))
        return cls(
            rows=tuple(StrategyRow.from_dict(row) for row in data["rows"]),
            device=str(data["device"]),
            repeats=int(data["repeats"]),
            label=str(data.get("label", "")),
            baseline=str(data.get("baseline", _BASELINE)),
            meta=dict(data.get("meta", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> ComparisonResult:
        """Rebuild a result from :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))


def _report_error(report: Any) -> float | None:
    if report is None:
        return None
    # The contract's "passed" covers the loss and every parameter gradient.
    return float(max(report.max_rel_error, report.loss_rel_error))


def _change_pct(value: int, base: int) -> float:
    return 100.0 * (value / base - 1.0) if base else 0.0
