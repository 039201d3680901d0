"""``remat doctor``'s report for people: the steps, the blocks at the peak, a snapshot read,
and each finding with its fix (:class:`~remat.core.doctor.DoctorReport`).

Nothing here measures; every figure comes from the report and is formatted with
:mod:`remat.units`.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from remat.core.cost import Category
from remat.core.doctor import ERROR, Cause, DoctorReport, Finding
from remat.core.snapshot import SnapshotDiagnosis, SnapshotMoment
from remat.units import format_bytes

#: The peak's categories, grouped into the columns of the steps table.
GROUPS: tuple[tuple[str, tuple[Category, ...]], ...] = (
    ("Parameters", (Category.PARAMETERS, Category.BUFFERS)),
    ("Gradients", (Category.GRADIENTS,)),
    ("Optimizer\nstate", (Category.OPTIMIZER_STATE,)),
    ("Activations", (Category.ACTIVATIONS, Category.RECOMPUTED)),
    ("Other", (Category.BACKWARD_TEMPORARIES, Category.OPTIMIZER_TEMPORARIES,
               Category.STEP_TEMPORARIES, Category.BATCH, Category.OTHER)),
)

_TITLES = {
    Cause.GRADIENTS_KEPT: "Gradients held across steps",
    Cause.OUTPUTS_KEPT: "Tensors kept across steps",
    Cause.STATE_GROWS: "Module state grows",
    Cause.RECOMPUTE_GROWS: "Module state grows, in recomputation too",
    Cause.GROWS: "Memory grows",
    Cause.FRAGMENTATION: "Fragmentation",
    Cause.ACTIVATIONS: "Out of memory: activations",
    Cause.SHAPE: "Out of memory: the step is too large",
}


def _group(breakdown: Mapping[Category, int], categories: tuple[Category, ...]) -> int:
    return sum(breakdown.get(c, 0) for c in categories)


def steps_table(report: DoctorReport, *, title: str | None = None) -> Table:
    """One row per step: the peak and what it is by category, bytes held over from earlier
    steps at the peak, the growth over the step, the reserved peak on CUDA."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="Peak: bytes alive at the step's peak, by category. Held: bytes "
                          "earlier steps left, alive at this step's peak. Growth: bytes alive "
                          "after the step less before it. Reserved: what PyTorch's CUDA "
                          "caching allocator would reserve in the step (modelled).",
                  caption_justify="left")
    table.add_column("Step", justify="right")
    table.add_column("Peak", justify="right")
    table.add_column("Phase")
    for name, _ in GROUPS:
        table.add_column(name, justify="right")
    table.add_column("Held", justify="right")
    table.add_column("Growth", justify="right")
    table.add_column("Reserved\n(CUDA)", justify="right")
    for row in report.steps:
        groups = [format_bytes(_group(row.peak_breakdown, cats)) for _, cats in GROUPS]
        table.add_row(
            str(row.step), format_bytes(row.peak_bytes), row.peak_phase or "-", *groups,
            format_bytes(row.held_total_bytes) if row.held_bytes else "-",
            _growth_cell(row.growth_bytes, row.step),
            format_bytes(row.reserved_bytes) if row.reserved_bytes is not None else "-")
    return table


def _growth_cell(nbytes: int, step: int) -> Text:
    return Text(format_bytes(nbytes, signed=True) if nbytes else "0",
                style="red" if nbytes > 0 and step > 1 else "")


def growth_table(report: DoctorReport) -> Table | None:
    """What grows: each holder's change over each step (None when nothing changed)."""
    holders = list(dict.fromkeys(h for row in report.steps for h in row.growth))
    if not holders:
        return None
    table = Table(title="What grows: bytes alive after each step less before it, by what "
                        "holds them", box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    table.add_column("Held by")
    for row in report.steps:
        table.add_column(f"Step {row.step}", justify="right")
    for holder in holders:
        table.add_row(Text(holder), *(_growth_cell(row.growth.get(holder, 0), row.step)
                                      for row in report.steps))
    return table


def blocks_table(report: DoctorReport) -> Table | None:
    """Activation bytes alive at the highest peak, by block (None without blocks)."""
    if not report.steps:
        return None
    row = max(report.steps, key=lambda r: (r.peak_bytes, r.step))
    if not row.peak_blocks:
        return None
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("Block")
    table.add_column(f"Activations at step {row.step}'s peak", justify="right")
    for name, nbytes in row.peak_blocks.items():
        table.add_row(name, format_bytes(nbytes))
    return table


def finding_text(finding: Finding) -> str:
    """One finding as a sentence with its figures (the fix is separate)."""
    size = format_bytes(finding.size_bytes)
    if finding.cause is Cause.GRADIENTS_KEPT:
        return (f"{size} of gradients from step {(finding.step or 2) - 1} are alive at step "
                f"{finding.step}'s peak: {finding.detail}.")
    if finding.cause in (Cause.STATE_GROWS, Cause.RECOMPUTE_GROWS, Cause.OUTPUTS_KEPT,
                         Cause.GROWS):
        return (f"{finding.holder or 'memory'} grows by {format_bytes(finding.growth_bytes)} "
                f"per step from step {finding.step} on ({size} after the last step): "
                f"{finding.detail}.")
    if finding.cause is Cause.FRAGMENTATION and finding.step is not None:
        if finding.severity == ERROR:
            return (f"Reserved bytes grow by {format_bytes(finding.growth_bytes)} per step: "
                    f"{finding.detail}.")
        return f"{finding.detail} ({size} less reserved)."
    site = f" Most bytes were allocated at {finding.holder}." if finding.holder else ""
    if finding.cause is Cause.FRAGMENTATION:
        if finding.severity == ERROR:
            return f"A request of {size} failed: {finding.detail}.{site}"
        return f"{size} of what the allocator reserves are free blocks: {finding.detail}."
    return f"The step is short of {size}: {finding.detail}.{site}"


def findings_renderable(report: DoctorReport) -> RenderableType:
    """Each finding (title, sentence, fix), then the verdict."""
    parts: list[RenderableType] = []
    for finding in report.findings:
        style = "bold red" if finding.severity == ERROR else "bold yellow"
        mark = "problem" if finding.severity == ERROR else "advice"
        parts.append(Text.assemble((f"{_TITLES[finding.cause]} ({mark})", style), "\n  ",
                                   finding_text(finding), "\n  fix: ", finding.fix))
    parts.append(verdict(report))
    return Group(*parts)


def verdict(report: DoctorReport) -> Text:
    """The last line: healthy, or how many problems."""
    if report.healthy:
        what = "memory is steady after the first step" if report.steps else \
            "no out-of-memory event, nothing to fix"
        return Text(f"Healthy: {what}.", style="bold green")
    n = len(report.errors)
    return Text(f"Unhealthy: {n} problem{'s' if n > 1 else ''} (fixes above).",
                style="bold red")


def snapshot_table(diagnosis: SnapshotDiagnosis, *, title: str | None = None) -> Table:
    """The allocator at the out-of-memory event, at the peak and at the dump: allocated by
    category, reserved, free blocks, the largest one, and the failed request."""
    moments: list[tuple[str, SnapshotMoment]] = []
    oom = diagnosis.out_of_memory
    if oom is not None:
        moments.append(("Out of memory", oom.moment))
    if diagnosis.peak is not None:
        moments.append(("Peak", diagnosis.peak))
    moments.append(("At the dump", diagnosis.at_dump))
    caption = [] if diagnosis.traced else ["No trace (record_memory_history was off): only "
                                           "the moment of the dump is known."]
    if not diagnosis.framed:
        caption.append("No frames: categories unknown (other).")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False,
                  caption=" ".join(caption) or None, caption_justify="left")
    table.add_column("")
    for name, _ in moments:
        table.add_column(name, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("Allocated", [format_bytes(m.allocated_bytes) for _, m in moments])]
    categories = list(dict.fromkeys(c for _, m in moments for c in m.by_category))
    for category in categories:
        label = "  other (frames do not say)" if category is Category.OTHER else \
            f"  {category.value.replace('_', ' ')}"
        rows.append((label, [format_bytes(m.by_category.get(category, 0)) for _, m in moments]))
    rows += [
        ("Reserved", [format_bytes(m.reserved_bytes) for _, m in moments]),
        ("Free in reserved", [format_bytes(m.free_reserved_bytes) for _, m in moments]),
        ("Largest free block", [format_bytes(m.largest_free_bytes) for _, m in moments]),
    ]
    if oom is not None:
        blank = [""] * (len(moments) - 1)
        rows += [("Failed request", [format_bytes(oom.requested_bytes), *blank]),
                 ("Largest free block it could use",
                  [format_bytes(oom.moment.largest_usable_free_bytes or 0), *blank]),
                 ("Free on the device", [format_bytes(oom.device_free_bytes), *blank]),
                 ("Short by", [format_bytes(oom.short_bytes), *blank])]
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


def sites_table(moment: SnapshotMoment, *, title: str) -> Table | None:
    """The allocation sites holding the most bytes at ``moment`` (None when unknown)."""
    if not moment.sites:
        return None
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("Allocated at")
    table.add_column("Bytes", justify="right")
    for site, nbytes in moment.sites:
        table.add_row(Text(site), format_bytes(nbytes))
    return table


def doctor_renderables(report: DoctorReport, *, title: str | None = None) -> list[RenderableType]:
    """Everything ``remat doctor`` prints, in order."""
    out: list[RenderableType] = []
    if report.steps:
        out.append(steps_table(report, title=title))
        for table in (growth_table(report), blocks_table(report)):
            if table is not None:
                out.append(table)
    if report.snapshot is not None:
        diagnosis = report.snapshot
        out.append(snapshot_table(diagnosis, title=None if report.steps else title))
        moment = diagnosis.out_of_memory.moment if diagnosis.out_of_memory is not None \
            else diagnosis.peak or diagnosis.at_dump
        sites = sites_table(moment, title="Where the bytes were allocated")
        if sites is not None:
            out.append(sites)
    out.append(findings_renderable(report))
    return out
