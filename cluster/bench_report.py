"""Reports of `splitspec bench` rows: the text table and the PNG plot."""

from __future__ import annotations

from collections.abc import Sequence


def best_modes(rows: Sequence[dict]) -> set[tuple[str, int, str]]:
    """(workload, concurrency, mode) of the highest output tokens/s per (workload, concurrency)."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["workload"], r["concurrency"])
        if key not in best or r["output_tokens_per_s"] > best[key]["output_tokens_per_s"]:
            best[key] = r
    return {(w, c, r["mode"]) for (w, c), r in best.items()}


def format_table(rows: Sequence[dict]) -> str:
    """One block per workload; rows concurrency x mode; `*` marks the best tok/s per concurrency."""
    best = best_modes(rows)
    off = {(r["workload"], r["concurrency"]): r["output_tokens_per_s"] for r in rows if r["mode"] == "off"}
    header = (f"{'conc':>5}  {'mode':<16} {'tok/s':>9} {'vs off':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
              f"{'ITL p50':>8} {'accept':>7} {'MAL':>5} {'errors':>6}")
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [workload, header]
        for r in sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["concurrency"]):
            base = off.get((workload, r["concurrency"]))
            ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
            mark = "*" if (workload, r["concurrency"], r["mode"]) in best else " "
            lines.append(f"{r['concurrency']:>5}  {r['mode']:<16} {r['output_tokens_per_s']:>8.1f}{mark} {ratio:>7} "
                         f"{r['ttft_ms_p50']:>6.0f} ms {r['tpot_ms_p50']:>6.0f} ms {r['itl_ms_p50']:>5.0f} ms "
                         f"{r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>5.2f} {r['errors']:>6}")
        lines.append("")
    lines.append("* best output tokens/s at that concurrency; MAL: mean acceptance length")
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
