"""What a tracked run shows: the terminal table, the JSON document and the figure.

All three read the same things from a finished :class:`~zero.profiler.tracker.MemoryTracker`:
its samples (bytes per category at each point), the sample with the allocator's highest
figure (the peak, with its breakdown by category, label and module), and the allocator's
true maximum, which can fall inside an operator, between two samples.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from zero.memory import CATEGORIES

if TYPE_CHECKING:
    from zero.profiler.tracker import MemoryTracker, Sample

MiB = 2**20


def peak_sample(tracker: "MemoryTracker") -> "Sample":
    """The sample with the allocator's highest figure (the first, if several tie)."""
    if not tracker.samples:
        raise ValueError("nothing was recorded: use the tracker as a context manager around training steps")
    return max(tracker.samples, key=lambda s: (s.allocated, -s.index))


def between_steps(tracker: "MemoryTracker") -> "Sample | None":
    """The last sample taken right after an optimizer step (model state at rest, gradients included)."""
    after = [s for s in tracker.samples if s.event == "optimizer step ends"]
    return after[-1] if after else None


def top_modules(sample: "Sample", count: int = 8) -> list[tuple[str, int]]:
    """Modules holding the most bytes at ``sample`` (activations and temporaries they created,
    stage-3 units' gathered parameters); model-wide buffers are left out."""
    named = [(m, b) for m, b in sample.modules.items() if m]
    return sorted(named, key=lambda x: -x[1])[:count]


def table(tracker: "MemoryTracker") -> str:
    """The terminal report: per category at the peak and between steps, the largest labels and
    modules at the peak, and how well the categories reconcile with the allocator."""
    peak = peak_sample(tracker)
    rest = between_steps(tracker)
    samples = tracker.samples
    worst = max(samples, key=lambda s: abs(s.unexplained))
    lines = [
        f"Memory on {tracker.device} ({len(samples)} samples, {tracker.steps} optimizer steps); "
        f"reconciled with {tracker.allocator.name}",
        f"peak {peak.allocated / MiB:.2f} MiB after {peak.step} optimizer steps, in {peak.phase}, "
        f"{peak.module or 'outside modules'}: {peak.event}",
    ]
    if tracker.allocator.peak > peak.allocated:
        lines.append(f"  (the allocator's maximum, inside an operator after that sample: {tracker.allocator.peak / MiB:.2f} MiB)")
    lines += ["", f"{'category':<18}{'at peak':>12}{'between steps':>15}{'max':>12}   (MiB)"]
    for c in CATEGORIES:
        at_rest = f"{rest.categories[c] / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
        top = max(s.categories[c] for s in samples)
        lines.append(f"{c:<18}{peak.categories[c] / MiB:>12.2f}{at_rest}{top / MiB:>12.2f}")
    unexplained = f"{rest.unexplained / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
    lines.append(f"{'unexplained':<18}{peak.unexplained / MiB:>12.2f}{unexplained}{worst.unexplained / MiB:>12.2f}")
    total_rest = f"{rest.allocated / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
    lines.append(f"{'allocator total':<18}{peak.allocated / MiB:>12.2f}{total_rest}{tracker.allocator.peak / MiB:>12.2f}")
    lines += ["", "at the peak, by label:"]
    for label, nbytes in sorted(peak.labels.items(), key=lambda x: -x[1]):
        if nbytes >= 0.001 * peak.allocated:
            lines.append(f"  {label:<44}{nbytes / MiB:>10.2f}")
    modules = top_modules(peak)
    if modules:
        lines += ["", "at the peak, by module (what it created or gathered):"]
        lines += [f"  {m:<44}{b / MiB:>10.2f}" for m, b in modules]
    share = abs(worst.unexplained) / max(tracker.allocator.peak, 1)
    lines += ["", f"largest unexplained: {worst.unexplained:+,} bytes ({share:.2%} of the peak) at sample {worst.index} ({worst.event})"]
    return "\n".join(lines)


def as_dict(tracker: "MemoryTracker") -> dict[str, Any]:
    """Everything the report shows, as plain data (bytes)."""
    peak = peak_sample(tracker)
    rest = between_steps(tracker)

    def breakdown(s: "Sample") -> dict[str, Any]:
        return {
            "index": s.index, "step": s.step, "phase": s.phase, "module": s.module, "event": s.event,
            "allocated": s.allocated, "unexplained": s.unexplained, "categories": s.categories,
            "labels": s.labels, "modules": s.modules,
        }

    return {
        "device": str(tracker.device),
        "allocator": tracker.allocator.name,
        "steps": tracker.steps,
        "allocator_peak": tracker.allocator.peak,
        "peak": breakdown(peak),
        "between_steps": breakdown(rest) if rest is not None else None,
        "categories": list(CATEGORIES),
        "timeline": {
            "time": [round(s.time, 6) for s in tracker.samples],
            "step": [s.step for s in tracker.samples],
            "phase": [s.phase for s in tracker.samples],
            "module": [s.module for s in tracker.samples],
            "allocated": [s.allocated for s in tracker.samples],
            **{c: [s.categories[c] for s in tracker.samples] for c in CATEGORIES},
        },
    }


def to_json(tracker: "MemoryTracker", path: str | None = None) -> str:
    text = json.dumps(as_dict(tracker), indent=1)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


def plot(tracker: "MemoryTracker", path: str) -> None:
    """A stacked timeline by category (with the allocator's figure on top) and bars per module at the peak."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("the memory plot needs matplotlib: pip install matplotlib") from err
    samples = tracker.samples
    peak = peak_sample(tracker)
    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 1]})
    x = list(range(len(samples)))
    timeline.stackplot(x, *[[s.categories[c] / MiB for s in samples] for c in CATEGORIES], labels=CATEGORIES)
    timeline.plot(x, [s.allocated / MiB for s in samples], color="black", linewidth=0.8, label="allocator")
    timeline.axvline(peak.index, color="red", linestyle=":", linewidth=1)
    for s in samples:
        if s.event == "optimizer step ends":
            timeline.axvline(s.index, color="grey", linewidth=0.5)
    timeline.set_xlabel("sample (grey: optimizer steps; red: peak)")
    timeline.set_ylabel("MiB")
    timeline.set_title(f"memory on {tracker.device} by category")
    timeline.legend(loc="upper left", fontsize=8)
    modules = top_modules(peak, 12)[::-1]
    bars.barh([m for m, _ in modules], [b / MiB for _, b in modules])
    bars.set_xlabel("MiB at the peak")
    bars.set_title("by module")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
