"""A picture of one step: live bytes over the step's ops, stacked by category, per strategy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat.errors import message
from remat.units import format_bytes, mib

if TYPE_CHECKING:
    from remat.core.results import Profile
    from remat.core.timeline import MemoryTimeline

_API = "remat.report.plot_timeline"
_ORDER = ("parameters", "buffers", "gradients", "optimizer_state", "batch", "other",
          "activations", "recomputed", "backward_temporaries", "optimizer_temporaries")
_PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fde0c5", "recompute": "#f6c6c6",
                 "optimizer": "#dcefd9"}
_MAX_GROUPS = 6


def _block_groups(blocks: list[str]) -> dict[str, str]:
    """Each block's label: itself, or with many blocks its group (``blocks.0-3``)."""
    if len(blocks) <= _MAX_GROUPS:
        return {b: b for b in blocks}
    size = -(-len(blocks) // _MAX_GROUPS)
    out: dict[str, str] = {}
    for start in range(0, len(blocks), size):
        group = blocks[start:start + size]
        label = group[0] if len(group) == 1 else f"{group[0]} .. {group[-1].rsplit('.', 1)[-1]}"
        out.update(dict.fromkeys(group, label))
    return out


def timeline_series(timeline: MemoryTimeline) -> dict[str, list[int]]:
    """The stacked series a timeline plot draws: bytes per label at every sample.

    Categories in a fixed order (parameters first); activations split per block (or
    per group of blocks past six), ``activations (no block)`` for the rest. The
    series sum to ``timeline.live_bytes`` at every sample.

    Example:
        >>> sum(v[timeline.peak_index] for v in timeline_series(timeline).values())
    """
    raw = timeline.series()
    blocks = [b for c, b in raw if c == "activations" and b is not None]
    groups = _block_groups(list(dict.fromkeys(sorted(blocks, key=_natural))))
    out: dict[str, list[int]] = {}
    for category in _ORDER:
        keys = sorted((k for k in raw if k[0] == category),
                      key=lambda k: (k[1] is not None, _natural(k[1] or "")))
        for key in keys:
            label = category.replace("_", " ")
            if category == "activations":
                label = (f"activations {groups[key[1]]}" if key[1] is not None
                         else "activations (no block)")
            values = out.setdefault(label, [0] * len(timeline.live_bytes))
            for i, v in enumerate(raw[key]):
                values[i] += v
    return out


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def plot_timeline(profiles: Profile | Sequence[Profile], path: str | Path, *,
                  titles: Sequence[str] | None = None, dpi: int = 120) -> Path:
    """Draw live bytes over each step's ops, stacked by category, one panel per profile.

    Each panel stacks parameters, gradients, optimizer state, saved activations per
    block (per group of blocks past six), recomputed activations and temporaries over
    the step's samples (about one per op); forward, backward, recompute and optimizer
    spans are shaded, and the peak is marked with what it is made of. Panels share the
    y axis, so strategies compare at a glance (``remat profile --strategy none,full
    --timeline out.png``).

    Args:
        profiles: one :class:`~remat.core.results.Profile` or several (tracked steps).
        path: output file; the format follows the suffix. Parents are created.
        titles: one title per profile. Default: ``"step"`` with the peak.
        dpi: resolution for raster formats. Default: 120.

    Returns:
        The path written.

    Example:
        >>> plot_timeline([prof_none, prof_full], "out/timeline.png",
        ...               titles=["gpt-small none", "gpt-small full"])  # doctest: +SKIP
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    items = [profiles] if not isinstance(profiles, Sequence) else list(profiles)
    if not items:
        raise ValueError(message(_API, "no profiles to plot", fix="pass one Profile or more"))
    missing = [i for i, p in enumerate(items) if p.timeline is None or not p.timeline.live_bytes]
    if missing:
        raise ValueError(message(_API, "a profile has no timeline",
                                 {"profiles": ", ".join(map(str, missing))},
                                 fix="plot profiles of tracked steps (remat.profile), not "
                                     "compiled or JAX ones"))
    names = list(titles) if titles is not None else ["step"] * len(items)
    if len(names) != len(items):
        raise ValueError(message(_API, "one title per profile",
                                 {"profiles": len(items), "titles": len(names)},
                                 fix="pass as many titles as profiles"))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.5 * len(items) + 1.5, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(items), sharey=True, squeeze=False)[0]
    colors: dict[str, str] = {}
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    palette = [cmap(i) for i in (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 1, 3, 5, 7, 9, 11, 13, 15,
                                 17, 19)]
    top = max(mib(max(p.timeline.live_bytes)) for p in items if p.timeline is not None)
    for ax, prof, name in zip(axes, items, names, strict=True):
        timeline = prof.timeline
        assert timeline is not None  # checked above
        _draw(ax, timeline, colors, palette, top)
        ax.set_title(f"{name}: peak {format_bytes(prof.peak_bytes)}", fontsize=10)
        ax.set_xlabel("op (sample) index in the step")
    axes[0].set_ylabel("live bytes (MiB)")
    handles, labels = axes[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    for ax in axes[1:]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, h)
    fig.legend(list(seen.values())[::-1], list(seen)[::-1], loc="outside right upper",
               fontsize=8)
    fig.savefig(out, dpi=dpi)
    return out


def _draw(ax: Any, timeline: MemoryTimeline, colors: dict[str, Any], palette: list[Any],
          top: float) -> None:
    series = timeline_series(timeline)
    x = range(len(timeline.live_bytes))
    for label in series:
        colors.setdefault(label, palette[len(colors) % len(palette)])
    ax.stackplot(x, *[[mib(v) for v in values] for values in series.values()],
                 labels=list(series), colors=[colors[k] for k in series], linewidth=0)
    shown: set[str] = set()
    for phase, first, end in timeline.phase_spans():
        ax.axvspan(first - 0.5, end - 0.5, color=_PHASE_COLORS[phase], alpha=0.5,
                   zorder=0, lw=0)
        if phase not in shown and (end - first) > len(timeline.live_bytes) * 0.04:
            shown.add(phase)
            ax.text((first + end) / 2, 0.985, phase, ha="center", va="top", fontsize=8,
                    color="#444444", transform=ax.get_xaxis_transform())
    peak = timeline.peak_index
    at_peak = sorted(((v[peak], k) for k, v in series.items() if v[peak]), reverse=True)
    lines = [f"peak {format_bytes(timeline.live_bytes[peak])} ({timeline.phases[peak]})"]
    lines += [f"{k}: {format_bytes(v)}" for v, k in at_peak[:6]]
    ax.plot([peak], [mib(timeline.live_bytes[peak])], marker="v", color="black")
    ax.annotate("\n".join(lines), xy=(peak, mib(timeline.live_bytes[peak])),
                xytext=(0.6 if peak < len(timeline.live_bytes) / 2 else 0.03, 0.55),
                textcoords="axes fraction", va="top", fontsize=7.5,
                bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85},
                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})
    ax.set_ylim(0, top * 1.08)
    ax.set_xlim(-0.5, len(timeline.live_bytes) - 0.5)
