#!/usr/bin/env python3
"""A layer from Python, step by step, and a picture of what it did.

    mpiexec -n 4 python3 scripts/layer_in_python.py inputs/quickstart.toml --steps 4 --png layer.png

Each rank feeds the deck's rows to the layer (NumPy arrays, in place), keeps
every step's report (stage seconds, dispatch ledger by link class, tasks of
the schedule), and rank 0 gathers them (mpi4py) and draws three panels:
stage seconds per step and rank, dispatch bytes by link class per rank, and
the last step's tasks as a Gantt chart per rank. The output digest printed
is kmoe-layer's output_digest of the same deck and step.
"""

import argparse
import sys

import numpy as np
from mpi4py import MPI

import kokkosmoe as km

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("deck")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--png", default="layer.png", help="the figure (rank 0 writes it)")
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.rank

# ---- run -------------------------------------------------------------------
with km.Layer(deck=args.deck, comm=comm) as layer:
    shape = layer.shape
    steps = []
    for step in range(args.steps):
        rows = layer.deck_rows(step)          # [tokens_per_rank, hidden]
        out = layer.forward(rows)             # a new array of the same shape
        report = layer.last_step()            # this rank's step, a dict
        if step == 0:
            digest = layer.digest(out)        # collective: every rank's rows
        steps.append(report)

everyone = comm.gather(steps, root=0)
if rank != 0:
    sys.exit(0)
print(f"layer: hidden={shape['hidden']} experts={shape['experts']} top_k={shape['top_k']} "
      f"dtype={shape['dtype']} ranks={comm.size} steps={args.steps} output_digest={digest}")

# ---- tables ------------------------------------------------------------------
stages = ["router", "dispatch", "experts", "combine_exchange", "combine"]
for r, rs in enumerate(everyone):
    s = rs[-1]["seconds"]
    print(f"rank {r}: " + " ".join(f"{k}={s.get(k, 0.0) * 1e3:.2f}ms" for k in stages + ["total"]))

# ---- figure ------------------------------------------------------------------
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib: the figure is not drawn")
    sys.exit(0)

fig, (ax_stages, ax_bytes, ax_gantt) = plt.subplots(3, 1, figsize=(9, 10))

# Stage seconds: one group of bars per stage, one bar per (rank, step) mean.
width = 0.8 / len(everyone)
for r, rs in enumerate(everyone):
    means = [np.mean([s["seconds"].get(k, 0.0) for s in rs]) * 1e3 for k in stages]
    ax_stages.bar(np.arange(len(stages)) + r * width, means, width, label=f"rank {r}")
ax_stages.set_xticks(np.arange(len(stages)) + 0.4 - width / 2, stages)
ax_stages.set_ylabel("ms per step (mean)")
ax_stages.legend(ncols=min(4, len(everyone)), fontsize="small")

# Dispatch bytes by link class, last step.
classes = ["same_rank", "intra_node", "inter_node"]
bottom = np.zeros(len(everyone))
for c in classes:
    values = []
    for rs in everyone:
        by_class = rs[-1]["ledger"]["dispatch"]["totals"]
        values.append(by_class.get(c, {}).get("payload_bytes", 0) / 1e6)
    ax_bytes.bar(np.arange(len(everyone)), values, bottom=bottom, label=c)
    bottom += np.array(values)
ax_bytes.set_xticks(np.arange(len(everyone)), [f"rank {r}" for r in range(len(everyone))])
ax_bytes.set_ylabel("dispatch payload MB")
ax_bytes.legend(fontsize="small")

# The last step's schedule: one row per (rank, stream), a colour per kind of task.
kinds = {}
rows, labels = 0, []
for r, rs in enumerate(everyone):
    tasks = rs[-1]["tasks"]
    for stream in sorted({t["stream"] for t in tasks}):
        for t in (t for t in tasks if t["stream"] == stream):
            kind = t["name"].split(" ")[0]
            colour = kinds.setdefault(kind, f"C{len(kinds) % 10}")
            ax_gantt.barh(rows, (t["end"] - t["start"]) * 1e3, left=t["start"] * 1e3, height=0.8, color=colour,
                          edgecolor="black", linewidth=0.3)
        labels.append(f"rank {r} {stream}")
        rows += 1
ax_gantt.legend(handles=[matplotlib.patches.Patch(color=c, label=k) for k, c in kinds.items()], fontsize="small",
                ncols=min(4, len(kinds)))
ax_gantt.set_yticks(range(rows), labels, fontsize="small")
ax_gantt.set_xlabel("ms from the step's start")
ax_gantt.invert_yaxis()
fig.tight_layout()
fig.savefig(args.png, dpi=90)
print(f"figure: {args.png}")
