"""What a tracked run shows: the terminal table, the JSON document and the figure.

All three read the same things from a finished run (a :class:`~zero.profiler.sample.Recording`, such as the
:class:`~zero.profiler.tracker.MemoryTracker` that calls them): its samples (bytes per category at each point),
the sample with the allocator's highest figure (the peak, with its breakdown by category, label and module),
and the allocator's true maximum, which can fall inside an operator, between two samples.
"""

from __future__ import annotations

import json
from typing import Any

from zero.memory import CATEGORIES
from zero.profiler.sample import Recording, Sample

MiB = 2**20


def peak_sample(tracker: Recording) -> Sample:
    """The sample with the allocator's highest figure (the first, if several tie)."""
    if not tracker.samples:
        raise ValueError("nothing was recorded: use the tracker as a context manager around training steps")
    return max(tracker.samples, key=lambda s: (s.allocated, -s.index))


def between_steps(tracker: Recording) -> Sample | None:
    """The last sample taken right after an optimizer step (model state at rest, gradients included)."""
    after = [s for s in tracker.samples if s.event == "optimizer step ends"]
    return after[-1] if after else None


def top_modules(sample: Sample, count: int = 8) -> list[tuple[str, int]]:
    """Modules holding the most bytes at ``sample`` (activations and temporaries they created,
    stage-3 units' gathered parameters); model-wide buffers are left out."""
    named = [(m, b) for m, b in sample.modules.items() if m]
    return sorted(named, key=lambda x: -x[1])[:count]


def table(tracker: Recording) -> str:
    """The terminal report: per category at the peak and between steps, the largest labels and
    modules at the peak, and how well the categories reconcile with the allocator."""
    peak = peak_sample(tracker)
    rest = between_steps(tracker)
    samples = tracker.samples
    worst = max(samples, key=lambda s: abs(s.unexplained))
    lines = [
        f"Memory on {tracker.device} ({len(samples)} samples, {steps_text(tracker.steps)}); "
        f"reconciled with {tracker.allocator.name}",
        f"peak {peak.allocated / MiB:.2f} MiB after {steps_text(peak.step)}, in {peak.phase}, "
        f"{peak.module or 'outside modules'}: {describe_event(peak.event)}",
    ]
    if tracker.allocator.peak > peak.allocated:
        lines.append(f"  (the allocator's maximum, inside an operator after that sample: "
                     f"{tracker.allocator.peak / MiB:.2f} MiB)")
    lines += ["", f"{'category':<18}{'at peak':>12}{'between steps':>15}{'max':>12}   (MiB)"]
    for c in CATEGORIES:
        at_rest = f"{rest.categories[c] / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
        top = max(s.categories[c] for s in samples)
        lines.append(f"{c:<18}{peak.categories[c] / MiB:>12.2f}{at_rest}{top / MiB:>12.2f}")
    unexplained = f"{rest.unexplained / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
    lines.append(f"{'unexplained':<18}{peak.unexplained / MiB:>12.2f}{unexplained}{worst.unexplained / MiB:>12.2f}")
    total_rest = f"{rest.allocated / MiB:>15.2f}" if rest is not None else f"{'-':>15}"
    lines.append(f"{'allocator total':<18}{peak.allocated / MiB:>12.2f}{total_rest}"
                 f"{tracker.allocator.peak / MiB:>12.2f}")
    lines += ["", "at the peak, by label:"]
    for label, nbytes in sorted(peak.labels.items(), key=lambda x: -x[1]):
        if nbytes >= 0.001 * peak.allocated:
            lines.append(f"  {label:<44}{nbytes / MiB:>10.2f}")
    modules = top_modules(peak)
    if modules:
        lines += ["", "at the peak, by module (what it created or gathered):"]
        lines += [f"  {m:<44}{b / MiB:>10.2f}" for m, b in modules]
    share = abs(worst.unexplained) / max(tracker.allocator.peak, 1)
    lines += ["", f"largest unexplained: {worst.unexplained:+,} bytes ({share:.2%} of the peak) "
                  f"at sample {worst.index} ({describe_event(worst.event)})"]
    return "\n".join(lines)


def steps_text(n: int) -> str:
    return f"{n} optimizer step{'' if n == 1 else 's'}"


def describe_event(event: str) -> str:
    """A sample's event in words: hooks name theirs already; an operator (``div_.Tensor``) becomes
    "the div operator (in place)" (the JSON keeps the raw name)."""
    if " " in event or event in ("start", "end"):
        return event
    name = event.split(".")[0]
    in_place = name.endswith("_") and not name.startswith("_")
    return f"the {name.strip('_')} operator" + (" (in place)" if in_place else "")


def as_dict(tracker: Recording) -> dict[str, Any]:
    """Everything the report shows, as plain data (bytes)."""
    peak = peak_sample(tracker)
    rest = between_steps(tracker)

    def breakdown(s: Sample) -> dict[str, Any]:
        return {
            "index": s.index, "step": s.step, "phase": s.phase, "module": s.module, "event": s.event,
            "allocated": s.allocated, "unexplained": s.unexplained, "categories": s.categories,
            "labels": s.labels, "modules": s.modules,
        }

    return {
        "device": str(tracker.device),
        "run": dict(tracker.run or {}),
        "allocator": tracker.allocator.name,
        "steps": tracker.steps,
        "allocator_peak": tracker.allocator.peak,
        "allocator_peak_without_collectives": tracker.allocator.peak_without_collectives,
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


def to_json(tracker: Recording, path: str | None = None) -> str:
    text = json.dumps(as_dict(tracker), indent=1)
    if path is not None:
        with open(path, "w") as f:
            f.write(text)
    return text


PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3", "step": "#55a868"}
CATEGORY_COLORS = dict(zip(CATEGORIES, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#7f7f7f")))
MODEL_WIDE = "(whole model)"  # bytes that serve no single module: the optimizer's state, model-wide buffers


def count_text(n: int) -> str:
    """A parameter count as people write it: 3.3M, 125K, 1.5B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def title_text(tracker: Recording, *, model: str | None = None, params: int | None = None,
               stage: int | None = None, world_size: int | None = None, rank: int | None = None) -> str:
    """The plot's title: ``GPT, 3.3M params, ZeRO stage 3, world size 2, rank 0 (cpu)``. Each figure the
    caller passes wins over what the tracker recorded from the model and optimizer it was given."""
    run = tracker.run or {}
    model = model if model is not None else run.get("model")
    params = params if params is not None else run.get("params")
    stage = stage if stage is not None else run.get("stage")
    world_size = world_size if world_size is not None else run.get("world_size", 1)
    rank = rank if rank is not None else run.get("rank", 0)
    parts = [model] if model else []
    if params is not None:
        parts.append(f"{count_text(params)} params")
    parts.append(f"ZeRO stage {stage}" if stage is not None else "no ZeRO")
    parts += [f"world size {world_size}", f"rank {rank}"]
    return ", ".join(parts) + f" ({tracker.device})"


def phase_spans(tracker: Recording) -> list[tuple[str, float, float]]:
    """Runs of consecutive samples in one phase: ``(phase, start, end)`` in seconds; a run lasts until the
    next run's first sample (the last one until the last sample). Idle runs are left out."""
    samples = tracker.samples
    spans: list[tuple[str, float, float]] = []
    first = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].phase != samples[first].phase:
            end = samples[min(i, len(samples) - 1)].time
            if samples[first].phase != "idle":
                spans.append((samples[first].phase, samples[first].time, end))
            first = i
    return spans


def module_bars(sample: Sample, count: int = 14) -> list[tuple[str, dict[str, int]]]:
    """Each module's own bytes at ``sample`` by category, largest first: what it created, saved or
    gathered, and the model state it holds. A storage is counted once, for the innermost module
    running when it was made, so a parent's figure never includes its children's. The ``count``
    largest modules, then one row for the rest; everything sums to the sample's total."""
    rows: dict[str, dict[str, int]] = {}
    for (module, category), nbytes in sample.module_categories.items():
        row = rows.setdefault(module or MODEL_WIDE, dict.fromkeys(CATEGORIES, 0))
        row[category] += nbytes
    for module, nbytes in sample.modules.items():  # what the allocator added after sampling: collectives' buffers
        row = rows.setdefault(module or MODEL_WIDE, dict.fromkeys(CATEGORIES, 0))
        row["communication" if module == "<collectives>" else "other"] += nbytes - sum(row.values())
    ranked = sorted(((m, r) for m, r in rows.items() if sum(r.values())), key=lambda x: -sum(x[1].values()))
    if len(ranked) > count + 1:
        rest = dict.fromkeys(CATEGORIES, 0)
        for _, row in ranked[count:]:
            for c in CATEGORIES:
                rest[c] += row[c]
        ranked = ranked[:count] + [(f"({len(ranked) - count} other modules)", rest)]
    return ranked


def plot(tracker: Recording, path: str, **title: Any) -> None:
    """Save :func:`figure` to ``path`` (PNG, or any format matplotlib knows from the suffix)."""
    fig = figure(tracker, **title)  # (raises a clear error without matplotlib)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def figure(tracker: Recording, **title: Any) -> Any:
    """The memory figure, a matplotlib ``Figure`` (the Agg backend; close it with ``plt.close``).

    Left: bytes by category over time (stacked), the allocator's figure on top, the phases
    (forward, backward, recompute, step) shaded behind, and the peak marked with its value.
    Right: each module's own bytes at the peak, stacked by category (model state included).
    The title names the model's size, the ZeRO stage, the world size and the rank, as the tracker
    recorded them; ``title`` keywords (``model``, ``params``, ``stage``, ``world_size``, ``rank``)
    override them.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ValueError("the memory plot needs matplotlib: pip install matplotlib") from err
    samples = tracker.samples
    peak = peak_sample(tracker)
    fig, (timeline, bars) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [2.2, 1]})
    fig.suptitle(title_text(tracker, **title), fontsize=13)

    # the timeline: phases behind, categories stacked, the allocator's figure, the peak
    seen_phases: set[str] = set()
    for phase, start, end in phase_spans(tracker):
        color = PHASE_COLORS.get(phase, "#cccccc")
        timeline.axvspan(start, end, color=color, alpha=0.18, linewidth=0, zorder=0, gid=f"phase:{phase}",
                         label=f"{phase}" if phase not in seen_phases else None)
        seen_phases.add(phase)
    t = [s.time for s in samples]
    present = [c for c in CATEGORIES if any(s.categories[c] for s in samples)]
    timeline.stackplot(t, *[[s.categories[c] / MiB for s in samples] for c in present],
                       colors=[CATEGORY_COLORS[c] for c in present], alpha=0.85, zorder=2)
    timeline.plot(t, [s.allocated / MiB for s in samples], color="black", linewidth=0.9, zorder=3,
                  label="allocator total")
    top = peak.allocated / MiB
    timeline.plot([peak.time], [top], marker="v", color="red", markersize=9, zorder=4, linestyle="none",
                  label="peak")
    note = f"peak {top:.2f} MiB"
    if tracker.allocator.peak > peak.allocated:
        note += f"\n(inside an operator: {tracker.allocator.peak / MiB:.2f} MiB)"
    note += f"\n{peak.phase}, {peak.module or 'outside modules'}"
    right = peak.time - t[0] > 0.6 * (t[-1] - t[0])  # the note on the side with room
    timeline.annotate(note, xy=(peak.time, top), xytext=(-12 if right else 12, 8), textcoords="offset points",
                      ha="right" if right else "left", va="bottom", fontsize=9, color="darkred", zorder=5,
                      gid="peak", bbox={"boxstyle": "round", "fc": "white", "ec": "darkred", "alpha": 0.9})
    timeline.set_xlim(t[0], max(t[-1], t[0] + 1e-6))
    timeline.set_ylim(0, max(top, tracker.allocator.peak / MiB) * 1.3)
    timeline.set_xlabel(f"time since profiling started (s; {len(samples)} samples, {steps_text(tracker.steps)})")
    timeline.set_ylabel("MiB")
    timeline.set_title("memory by category over time (shaded: phases)", fontsize=11)
    timeline.grid(axis="y", alpha=0.3)
    timeline.legend(loc="upper left", fontsize=8, ncol=2, framealpha=0.9)

    # per module at the peak: own bytes only, stacked by category
    rows = module_bars(peak)[::-1]
    names = [m for m, _ in rows]
    left = [0.0] * len(rows)
    for c in CATEGORIES:
        widths = [row[c] / MiB for _, row in rows]
        if any(widths):
            bars.barh(names, widths, left=left, color=CATEGORY_COLORS[c], label=c, gid=f"module:{c}")
            left = [a + b for a, b in zip(left, widths)]
    bars.set_xlim(0, max(left, default=0) * 1.05 or 1)
    bars.set_xlabel("MiB at the peak: each module's own bytes\n(self only: its children's bytes are not included)")
    bars.set_title("by module at the peak", fontsize=11)
    bars.tick_params(axis="y", labelsize=8)
    bars.grid(axis="x", alpha=0.3)
    # one key for the colors of both panels, under them
    handles = [Patch(color=CATEGORY_COLORS[c], label=c)
               for c in CATEGORIES if c in present or any(r[c] for _, r in rows)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False,
               title="category (both panels)", title_fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
