"""The GPU section of docs/benchmarks.md, from ``benchmarks/results/gpu.json`` (written by ``benchmarks/gpu_check.py``
on a lent GPU). Without that file the section says that nothing has been measured on a GPU yet, and how to."""

from __future__ import annotations

GIB = 2**30
REFRESH = "python benchmarks/gpu_check.py && python benchmarks/render_results.py --write"


def gpu_section(data: dict | None) -> list[str]:
    """The section's lines."""
    out = ["## On a GPU", ""]
    if data is None:
        return out + [
            "`benchmarks/gpu_check.py` has not run on a GPU yet (`benchmarks/results/gpu.json` does not exist), so "
            "no figure here is from a GPU. On a machine with one (a lent H100 or H200 runs it in under 9 minutes), "
            "this writes the JSON and renders this section:", "",
            "```sh", REFRESH, "```", ""]
    run, parts = data["run"], data["parts"]
    out += [f"Measured by `benchmarks/gpu_check.py` on {run['device']}, {run['date']}, torch {run['torch']}"
            + (f", Triton {run['triton']}" if run.get("triton") else "")
            + (f", at commit `{run['commit']}`" if run.get("commit") else "") + ".", ""]
    out += [f"- `{name}`: {part['status']}" + (f" ({part['seconds']:.0f} s)" if "seconds" in part else "")
            for name, part in parts.items()]
    out.append("")
    tests = parts.get("tests", {}).get("result")
    if tests:
        out += [f"GPU tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped.", ""]
        out += [f"- {failure}" for failure in tests["failures"]] + ([""] if tests["failures"] else [])
    out += _step_table(parts) + _offload_table(parts)
    if data["targets"]:
        out += ["| target | ratio | limit | result |", "|---|--:|--:|---|"]
        out += [f"| {t['check']} | {t['ratio']:.3f} | ≤ {t['limit']} | {'PASS' if t['passed'] else 'FAIL'} |"
                for t in data["targets"]]
        out.append("")
    return out + ["Regenerate on a GPU:", "", "```sh", REFRESH, "```", ""]


def _step_table(parts: dict) -> list[str]:
    """compare.py's contenders on the GPU (ratios to plain PyTorch where it ran), with the synchronizations and
    launches per step where ``syncs`` measured them."""
    compare = parts.get("compare", {}).get("result")
    if not compare:
        return []
    steps = (parts.get("syncs", {}).get("result") or {}).get("contenders", {})
    rows = compare["rows"]
    plain = next((r for r in rows if r["name"] == "plain"), None)
    cfg = compare["config"]
    out = [f"GPT of {compare['params'] / 1e6:.0f}M parameters (d_model {cfg['d_model']}, {cfg['num_layers']} blocks, "
           f"vocabulary {cfg['vocab_size']}, sequence {cfg['seq_len']}), global batch {compare['run']['batch']}, "
           f"world size {compare['world']}; step times are medians of {compare['run']['steps']} steps:", "",
           "| contender | step ms | × plain | peak GiB | host syncs / step | kernel launches / step |",
           "|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        s = steps.get(r["name"], {})
        ratio = f"{r['median_ms'] / plain['median_ms']:.2f}" if plain else "n/a"
        out.append(f"| `{r['name']}` | {r['median_ms']:.1f} | {ratio} | {r['peak'] / GIB:.2f} "
                   f"| {s.get('syncs_per_step', '')} | {s.get('launches_per_step', '')} |")
    return out + [""]


def _offload_table(parts: dict) -> list[str]:
    """offload_speed.py's rows: each configuration's step and its split, per model and cap."""
    result = parts.get("offload", {}).get("result")
    if not result:
        return []
    out = ["Offload under caps (`benchmarks/offload_speed.py`: stage 3, bf16, activation checkpointing, one rank):", "",
           "| model | cap GiB | configuration | ratio | step s | forward+backward s | host step s | transfers s |",
           "|---|--:|---|--:|--:|--:|--:|--:|"]
    for row in result["rows"]:
        for label in ("resident", "full", "auto"):
            r = row[label]
            head = f"| {row['model']} | {row['cap_bytes'] / GIB:.3g} | {label} |"
            if "error" in r:
                out.append(f"{head} {r['error'][:60]} | | | | |")
            else:
                out.append(f"{head} {r['ratio']:.3g} | {r['step_s']:.3f} | {r['forward_backward_s']:.3f} "
                           f"| {r['host_step_s']:.3f} | {r['transfers_s']:.3f} |")
    return out + [""]
