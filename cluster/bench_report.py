"""Reports of `splitspec bench` rows: the text table and the PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def best_modes(rows: Sequence[dict]) -> set[tuple[str, int, str]]:
    """(workload, concurrency, mode) of the highest output tokens/s per (workload, concurrency)."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["workload"], r["concurrency"])
        if key not in best or r["output_tokens_per_s"] > best[key]["output_tokens_per_s"]:
            best[key] = r
    return {(w, c, r["mode"]) for (w, c), r in best.items()}


def paired_ratio(row: dict, base: dict) -> float | None:
    """The median over repeats of `row`'s tok/s over `base`'s in the same repeat, or None
    without per-repeat figures of equal count (`output_tokens_per_s_by_repeat`).

    Repeat r of every mode of a (workload, concurrency) ran in one pass over the modes,
    so the machine's pace, which drifts between repeats by more than the modes differ,
    divides out of each repeat's ratio; the ratio of the medians keeps it.

    >>> paired_ratio({"output_tokens_per_s_by_repeat": [12.0, 30.0, 22.0]},
    ...              {"output_tokens_per_s_by_repeat": [10.0, 20.0, 20.0]})
    1.2
    """
    a, b = row.get("output_tokens_per_s_by_repeat"), base.get("output_tokens_per_s_by_repeat")
    if not a or not b or len(a) != len(b) or min(b) <= 0:
        return None
    return statistics.median(x / y for x, y in zip(a, b))


def against_best_static(rows: Sequence[dict]) -> list[dict]:
    """For each (workload, concurrency) and each mode named `auto...`: its ratio to the
    static mode (`static:...`) of the highest median tok/s there (`best_static`, `ratio`),
    and its lowest paired ratio to any static mode (`paired`, against `paired_static`;
    `paired_ratio`; None without per-repeat figures): above 1, auto beat every static mode
    repeat for repeat in the median. Empty where a run had no static or no auto mode."""
    out = []
    cells = dict.fromkeys((r["workload"], r["concurrency"]) for r in rows)
    for workload, concurrency in cells:
        cell = [r for r in rows if (r["workload"], r["concurrency"]) == (workload, concurrency)]
        statics = [r for r in cell if r["mode"].startswith("static:")]
        if not statics:
            continue
        best = max(statics, key=lambda r: r["output_tokens_per_s"])
        for r in cell:
            if not r["mode"].startswith("auto") or best["output_tokens_per_s"] <= 0:
                continue
            paired = [(p, s["mode"]) for s in statics if (p := paired_ratio(r, s)) is not None]
            low = min(paired) if len(paired) == len(statics) else (None, None)
            out.append({"workload": workload, "concurrency": concurrency, "mode": r["mode"],
                        "best_static": best["mode"], "ratio": r["output_tokens_per_s"] / best["output_tokens_per_s"],
                        "paired": low[0], "paired_static": low[1]})
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_table(rows: Sequence[dict]) -> str:
    """One block per workload; rows concurrency x mode; `*` marks the best tok/s per
    concurrency. `vs off`: the ratio of median tok/s to `off`'s; `paired`: the median of
    the per-repeat ratios (`paired_ratio`). Then auto against the static modes
    (`against_best_static`)."""
    best = best_modes(rows)
    off = {(r["workload"], r["concurrency"]): r for r in rows if r["mode"] == "off"}
    header = (f"{'conc':>5}  {'mode':<16} {'tok/s':>9} {'vs off':>7} {'paired':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
              f"{'ITL p50':>8} {'accept':>7} {'MAL':>5} {'errors':>6}")
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [workload, header]
        for r in sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["concurrency"]):
            base = off.get((workload, r["concurrency"]))
            ok = base is not None and base["output_tokens_per_s"] > 0
            ratio = _ratio(r["output_tokens_per_s"] / base["output_tokens_per_s"] if ok else None)
            paired = _ratio(paired_ratio(r, base) if ok else None)
            mark = "*" if (workload, r["concurrency"], r["mode"]) in best else " "
            lines.append(f"{r['concurrency']:>5}  {r['mode']:<16} {r['output_tokens_per_s']:>8.1f}{mark} {ratio:>7} "
                         f"{paired:>7} {r['ttft_ms_p50']:>6.0f} ms {r['tpot_ms_p50']:>6.0f} ms "
                         f"{r['itl_ms_p50']:>5.0f} ms {r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>5.2f} "
                         f"{r['errors']:>6}")
        lines.append("")
    lines.append("* best output tokens/s at that concurrency; MAL: mean acceptance length; "
                 "paired: the median of per-repeat ratios")
    versus = against_best_static(rows)
    if versus:
        lines += ["", "auto against the static modes (the ratio of medians to the best; "
                  "the lowest paired ratio to any):"]
        lines += [f"  {v['workload']} c={v['concurrency']} {v['mode']}: {_ratio(v['ratio'])} of {v['best_static']}; "
                  f"paired {_ratio(v['paired'])}" + (f" of {v['paired_static']}" if v["paired_static"] else "")
                  for v in versus]
    return "\n".join(lines)


def plot_rows(rows: Sequence[dict], path) -> None:
    """A PNG grid, one row per workload: output tokens/s and TPOT p50 vs concurrency, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    concurrency = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for (ax_tps, ax_tpot), workload in zip(axes, workloads):
        for mode in modes:
            pts = sorted((r["concurrency"], r["output_tokens_per_s"], r["tpot_ms_p50"]) for r in rows
                         if r["workload"] == workload and r["mode"] == mode)
            if pts:
                xs, tps, tpot = zip(*pts)
                ax_tps.plot(xs, tps, marker="o", label=mode)
                ax_tpot.plot(xs, tpot, marker="o", label=mode)
        for ax, title, ylabel in ((ax_tps, "output tokens/s", "tokens/s"), (ax_tpot, "TPOT p50", "ms")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{workload}: {title}")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
