#!/usr/bin/python3
"""Figures from a kmoe-layer run: stage time breakdown, ledger bars
(same-rank / intra-node / inter-node bytes per algorithm), a Gantt chart of
the last step's tasks per rank (schedule.png), drops and expert load over
steps.

    scripts/plot_report.py reports/quickstart.json [--hdf5 reports/quickstart.h5] [--out reports/figures]

Needs Debian's python3-matplotlib (and python3-h5py for the time series).
Writes stage_breakdown.png, ledger_bytes.png, schedule.png and, with the HDF5 file,
drops_and_load.png; for a run that rebalanced its placement ([placement]
rebalance_every), rank_load.png (ideal max/mean rank load per step of the
first placement and of the live one, each switch marked); for a training
run ([run] mode = "train"), loss_curve.png
(loss, gradient norm and balance loss per step) and backward_stages.png;
prints the paths it wrote.

Given a sweep table of kmoe-exchange --sweep (sweep.json), draws sweep.png:
dispatch + combine seconds per algorithm against the swept value, measured
(or emulated) as solid lines and the cost model's prediction dashed, with
the flat/hierarchical crossover marked where the order of the two changes
(measured and predicted separately; the last one, past which the order no
longer changes).
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGES = ["router", "route_plan", "dispatch", "experts", "combine_exchange", "combine", "shared_experts", "statistics",
          "other"]
CLASSES = ["same_rank", "intra_node", "inter_node"]


def save(fig, out, name):
    """Writes the figure as out/name and returns the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fail(message):
    print(f"plot_report.py: {message}", file=sys.stderr)
    sys.exit(1)


def stage_breakdown(report, out):
    algorithms = list(report["algorithms"].keys())
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(algorithms)
    for stage in STAGES:
        values = [1e3 * report["algorithms"][a]["stage_seconds"].get(stage, 0.0) for a in algorithms]
        if not any(values):
            continue
        ax.bar(algorithms, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step (slowest rank per stage)")
    ax.set_title(f"Stage times, {report['ranks']} ranks on {report['nodes']} nodes, "
                 f"{report['tokens_per_rank']} tokens/rank")
    ax.legend(fontsize=7, ncol=2)
    return save(fig, out, "stage_breakdown.png")


def ledger_bytes(report, out):
    algorithms = list(report["algorithms"].keys())
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, direction in zip(axes, ["dispatch", "combine"]):
        bottom = [0.0] * len(algorithms)
        for cls in CLASSES:
            values = [report["algorithms"][a]["ledger_last_step"][direction]["totals"][cls]["payload_bytes"] / 1e6
                      for a in algorithms]
            ax.bar(algorithms, values, bottom=bottom, label=cls)
            bottom = [b + v for b, v in zip(bottom, values)]
        relay = [report["algorithms"][a]["ledger_last_step"][direction]["relay_bytes"] / 1e6 for a in algorithms]
        ax.plot(algorithms, relay, "k^", label="relay bytes")
        ax.set_title(f"{direction} payload (last step, all ranks)")
        ax.set_ylabel("MB")
        ax.legend(fontsize=7)
    return save(fig, out, "ledger_bytes.png")


def schedule_gantt(report, out):
    """One row per (rank, stream), one bar per task of the last step."""
    algorithms = [a for a in report["algorithms"] if report["algorithms"][a].get("tasks_last_step")]
    if not algorithms:
        return None
    fig, axes = plt.subplots(len(algorithms), 1, figsize=(9, 1.2 + 1.6 * len(algorithms) * report["ranks"] ** 0.5),
                             squeeze=False)
    colors = {}
    for ax, a in zip(axes[:, 0], algorithms):
        tasks = report["algorithms"][a]["tasks_last_step"]
        streams = []
        for t in tasks:
            if t["stream"] not in streams:
                streams.append(t["stream"])
        labels = []
        for r in range(report["ranks"]):
            for s in streams:
                labels.append(f"rank {r} {s}")
        for t in tasks:
            kind = t["name"].split(" ")[0]
            color = colors.setdefault(kind, f"C{len(colors) % 10}")
            for r in range(report["ranks"]):
                row = r * len(streams) + streams.index(t["stream"])
                start, end = t["start_by_rank"][r], t["end_by_rank"][r]
                ax.barh(row, 1e3 * (end - start), left=1e3 * start, color=color, edgecolor="black", linewidth=0.3,
                        label=kind if r == 0 else None)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(f"{a}: {report['algorithms'][a].get('schedule', '')}, last step", fontsize=9)
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=6, ncol=len(unique), loc="lower right")
    axes[-1, 0].set_xlabel("ms from the start of the step's task graph")
    return save(fig, out, "schedule.png")


def drops_and_load(h5path, out):
    try:
        import h5py
    except ImportError:
        fail("reading the HDF5 time series needs python3-h5py")
    with h5py.File(h5path, "r") as f:
        steps = f["steps"]
        drops = {}
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and name.endswith("dropped_routes"):
                drops[name.replace("/dropped_routes", "").replace("dropped_routes", "run") or "run"] = obj[()]
        steps.visititems(visit)
        load = steps["expert_load"][()] if "expert_load" in steps else None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, series in sorted(drops.items()):
        axes[0].plot(range(len(series)), series, marker="o", label=name)
    axes[0].set_xlabel("measured step")
    axes[0].set_ylabel("dropped routes (all ranks)")
    axes[0].set_title("Drops per step")
    axes[0].legend(fontsize=7)
    if load is not None and load.size:
        im = axes[1].imshow(load.T, aspect="auto", origin="lower", interpolation="nearest")
        axes[1].set_xlabel("measured step")
        axes[1].set_ylabel("logical expert")
        axes[1].set_title("Routes per expert")
        fig.colorbar(im, ax=axes[1])
    return save(fig, out, "drops_and_load.png")


def rank_load(report, out):
    rb = report["rebalance"]
    first, live = rb["max_over_mean_first_placement"], rb["max_over_mean_live"]
    warmup = report.get("warmup", 0)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = range(warmup, warmup + len(live))
    ax.plot(steps, first, label=f"first placement (mean {rb['mean_max_over_mean_first_placement']:.3f})")
    ax.plot(steps, live, label=f"live placement (mean {rb['mean_max_over_mean_live']:.3f})")
    for i, sw in enumerate(rb["switches"]):
        ax.axvline(sw["after_step"] + 0.5, color="grey", linestyle=":", label="rebalanced" if i == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean rank load (ideal)")
    ax.set_title(f"{os.path.basename(report.get('deck', ''))}: rebalanced every {rb['every']} steps, "
                 f"{rb['generations']} switches, {report.get('ranks', '?')} ranks")
    ax.legend(fontsize="small")
    return save(fig, out, "rank_load.png")


def loss_curve(report, out):
    train = report["train"]
    loss = train["loss"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = range(1, len(loss) + 1)
    ax.semilogy(steps, loss, label="loss (mean squared error vs teacher)")
    ax.semilogy(steps, train["grad_norm"], label="gradient norm", alpha=0.7)
    if any(b > 0 for b in train.get("balance_loss", [])):
        ax.semilogy(steps, train["balance_loss"], label="balance loss", alpha=0.7)
    if loss and loss[0] > 0:
        ax.axhline(0.1 * loss[0], color="grey", linestyle=":", label="10 % of the first loss")
    ax.set_xlabel("step")
    ax.set_title(f"{os.path.basename(report.get('deck', ''))}: {train['optimizer']} lr {train['learning_rate']} "
                 f"({train.get('schedule', 'constant')}), {report.get('ranks', '?')} ranks, last/first {train['loss_ratio']:.3f}")
    ax.legend(fontsize="small")
    return save(fig, out, "loss_curve.png")


def backward_stages(report, out):
    stages = {k: v for k, v in report["train"]["backward_seconds_mean"].items() if k != "total"}
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(list(stages), [1e3 * v for v in stages.values()])
    ax.set_ylabel("ms per step (slowest rank, mean)")
    ax.set_title("backward stages")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    return save(fig, out, "backward_stages.png")


def crossovers(values, a, b):
    """Swept values between which series a stops (or starts) being faster than b."""
    out = []
    for i in range(1, len(values)):
        if None in (a[i - 1], a[i], b[i - 1], b[i]):
            continue
        d0, d1 = a[i - 1] - b[i - 1], a[i] - b[i]
        if d0 == 0 or d0 * d1 < 0:
            # linear interpolation of the difference's zero
            x = values[i - 1] + (values[i] - values[i - 1]) * (d0 / (d0 - d1) if d0 != d1 else 0.0)
            out.append(x)
    return out


def sweep_plot(table, out):
    rows = table["rows"]
    key = table["key"]
    try:
        order = sorted({float(r["value"]) for r in rows})
        numeric = True
    except ValueError:
        order = list(dict.fromkeys(r["value"] for r in rows))
        numeric = False
    xs = order if numeric else list(range(len(order)))
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for i, a in enumerate(algorithms):
        color = f"C{i}"
        for field, style, what in (("total_s", "-o", table.get("evidence", "measured")), ("model_total_s", "--x", "model")):
            ys = []
            for v in order:
                match = [r for r in rows if r["algorithm"] == a and (float(r["value"]) if numeric else r["value"]) == v]
                ys.append(match[0][field] if match and match[0][field] is not None else None)
            series[(a, field)] = ys
            if any(y is not None for y in ys):
                pts = [(x, 1e3 * y) for x, y in zip(xs, ys) if y is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{a} ({what})")
    if numeric and min(xs) > 0 and max(xs) / min(xs) >= 20:
        ax.set_xscale("log")
    # The last crossover of each class: past it the order no longer changes.
    for field, ls in (("total_s", ":"), ("model_total_s", "-.")):
        a, b = series.get(("flat", field)), series.get(("hierarchical", field))
        if a and b and numeric:
            found = crossovers(xs, a, b)
            if found:
                x = found[-1]
                what = "model" if field.startswith("model") else table.get("evidence", "measured")
                # Named in the legend: a label on the plot would cross the curves.
                ax.axvline(x, color="gray", linestyle=ls, linewidth=1, label=f"crossover ({what}): {key} ~ {x:.3g}")
    if not numeric:
        ax.set_xticks(xs)
        ax.set_xticklabels(order)
    ax.set_xlabel(key)
    ax.set_ylabel("dispatch + combine, ms (slowest rank)")
    ax.set_title(f"kmoe-exchange sweep of {key}, {table.get('ranks', '?')} ranks ({table.get('evidence', 'measured')} vs model)")
    ax.legend(fontsize=7)
    return save(fig, out, "sweep.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="JSON report of kmoe-layer, or a sweep table of kmoe-exchange --sweep")
    parser.add_argument("--hdf5", help="HDF5 time series of the same run (default: the report's name with .h5)")
    parser.add_argument("--out", help="output directory (default: <report dir>/figures)")
    args = parser.parse_args()
    try:
        with open(args.report) as f:
            report = json.load(f)
    except OSError as e:
        fail(f"cannot read report '{args.report}': {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"report '{args.report}' is not JSON: {e}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.report)), "figures")
    if report.get("format") == "kokkosmoe-sweep":
        if not report.get("rows"):
            fail(f"sweep '{args.report}' has no rows")
        os.makedirs(out, exist_ok=True)
        print(sweep_plot(report, out))
        return
    if "train" in report:
        os.makedirs(out, exist_ok=True)
        for p in (loss_curve(report, out), backward_stages(report, out)):
            print(p)
        return
    if "algorithms" not in report:
        fail(f"report '{args.report}' has no 'algorithms' (is it a kmoe-layer report?)")
    os.makedirs(out, exist_ok=True)
    written = [stage_breakdown(report, out), ledger_bytes(report, out)]
    gantt = schedule_gantt(report, out)
    if gantt:
        written.append(gantt)
    if report.get("rebalance", {}).get("max_over_mean_live"):
        written.append(rank_load(report, out))
    h5 = args.hdf5 or os.path.splitext(args.report)[0] + ".h5"
    if os.path.exists(h5):
        written.append(drops_and_load(h5, out))
    elif args.hdf5:
        fail(f"HDF5 file '{h5}' does not exist")
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
