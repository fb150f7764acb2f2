#!/usr/bin/env python3
"""Make a synthetic routing trace for KokkosMoE experiments.

    make_trace.py --kind drifting --steps 200 --ranks 4 --tokens 256 \
        --experts 64 --top-k 8 --out traces/drifting            (NumPy layout)
    make_trace.py ... --out traces/drifting.h5                   (HDF5, needs h5py)

Layout (src/layer/KokkosMoE_RouteTrace.hpp): arrays experts (int32) and
gates (float32) of shape [steps, ranks, tokens, top_k]; a directory with
experts.npy and gates.npy, or an .h5/.hdf5 file with datasets /experts and
/gates. Replay it with [tokens] source = "trace" (kmoe-layer, kmoe-exchange)
or drive placement with kmoe-eplb --trace.

With --logits the trace also holds router logits (float32, [steps, ranks,
tokens, experts]; logits.npy or /logits): log(weight) plus Gumbel noise per
token and expert, so that a softmax router's top-k of them is the same draw
(Gumbel top-k). The experts and gates arrays are then that router's choice:
the top_k largest logits, gates their softmax renormalized over the top_k.
kmoe-layer replays the logits through its own router ([tokens] replay =
"logits"): score function, correction bias, group limits and admission of
the deck apply.

Kinds (per step, a popularity weight per expert; every token draws top_k
distinct experts with probability proportional to the weights, gates are
their renormalized weights):
  uniform   every expert equally popular
  skewed    Zipf(s) popularity over a fixed random order of the experts
  drifting  Zipf(s) popularity whose ranking rotates: the hot experts move
            by --drift experts every step (load follows them)
  bursty    uniform, plus a random burst: with probability --burst-prob a
            step makes --hot experts carry --hot-fraction of the routes,
            lasting --burst-len steps
"""

import argparse
import os
import sys

import numpy as np


def popularity(kind, step, experts, rng_state, args):
    order = rng_state["order"]
    if kind == "uniform":
        return np.ones(experts)
    if kind in ("skewed", "drifting"):
        ranks = np.arange(1, experts + 1, dtype=np.float64)
        zipf = ranks ** (-args.zipf_s)
        w = np.empty(experts)
        shift = int(round(step * args.drift)) if kind == "drifting" else 0
        w[np.roll(order, shift)] = zipf
        return w
    if kind == "bursty":
        w = np.ones(experts)
        if rng_state["burst_left"] == 0 and rng_state["rng"].random() < args.burst_prob:
            rng_state["burst_left"] = args.burst_len
            rng_state["burst_experts"] = rng_state["rng"].choice(experts, size=args.hot, replace=False)
        if rng_state["burst_left"] > 0:
            rng_state["burst_left"] -= 1
            hot = rng_state["burst_experts"]
            cold = experts - len(hot)
            # hot experts carry hot_fraction of the weight, shared evenly
            w[:] = (1.0 - args.hot_fraction) / max(cold, 1)
            w[hot] = args.hot_fraction / len(hot)
        return w
    raise ValueError(kind)


def draw(weights, tokens, top_k, rng, logits=False):
    """top_k distinct experts per token, proportional to weights (Gumbel top-k).

    Returns ids, gates and (logits=True) the perturbed scores as float32
    logits, whose top_k are the ids and whose renormalized softmax over the
    top_k are the gates; otherwise the gates are the renormalized weights."""
    logw = np.log(np.maximum(weights, 1e-300))
    g = rng.gumbel(size=(tokens, len(weights))) + logw
    if logits:
        g = g.astype(np.float32).astype(np.float64)  # the values the trace stores
    ids = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
    # selection order: descending perturbed score
    sel = np.take_along_axis(g, ids, axis=1)
    order = np.argsort(-sel, axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    if logits:
        sel = np.take_along_axis(sel, order, axis=1)
        e = np.exp(sel - sel[:, :1])
        gates = e / e.sum(axis=1, keepdims=True)
        return ids.astype(np.int32), gates.astype(np.float32), g.astype(np.float32)
    gw = weights[ids]
    gates = gw / gw.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), gates.astype(np.float32), None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["uniform", "skewed", "drifting", "bursty"], default="drifting")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank and step")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--drift", type=float, default=0.5, help="drifting: experts the ranking moves per step")
    p.add_argument("--hot", type=int, default=4, help="bursty: experts of a burst")
    p.add_argument("--hot-fraction", type=float, default=0.5, help="bursty: share of the routes they carry")
    p.add_argument("--burst-prob", type=float, default=0.1)
    p.add_argument("--burst-len", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--logits", action="store_true", help="also store router logits (see above)")
    p.add_argument("--out", required=True, help="directory (NumPy layout) or .h5/.hdf5 file")
    a = p.parse_args(argv)
    for name in ("steps", "ranks", "tokens", "experts", "top_k", "burst_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.top_k > a.experts:
        p.error(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    if not 0 < a.hot <= a.experts:
        p.error(f"--hot {a.hot} must be in [1, --experts]")
    if not 0.0 <= a.hot_fraction <= 1.0 or not 0.0 <= a.burst_prob <= 1.0:
        p.error("--hot-fraction and --burst-prob must be in [0, 1]")

    rng = np.random.default_rng(a.seed)
    state = {"order": rng.permutation(a.experts), "rng": rng, "burst_left": 0, "burst_experts": None}
    experts = np.empty((a.steps, a.ranks, a.tokens, a.top_k), dtype=np.int32)
    gates = np.empty(experts.shape, dtype=np.float32)
    logits = np.empty((a.steps, a.ranks, a.tokens, a.experts), dtype=np.float32) if a.logits else None
    for s in range(a.steps):
        w = popularity(a.kind, s, a.experts, state, a)
        for r in range(a.ranks):
            experts[s, r], gates[s, r], z = draw(w, a.tokens, a.top_k, rng, a.logits)
            if logits is not None:
                logits[s, r] = z

    if a.out.endswith((".h5", ".hdf5")):
        try:
            import h5py
        except ImportError:
            sys.exit("make_trace.py: writing HDF5 needs h5py (python3-h5py); give a directory for the NumPy layout")
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with h5py.File(a.out, "w") as f:
            f.create_dataset("experts", data=experts)
            f.create_dataset("gates", data=gates)
            if logits is not None:
                f.create_dataset("logits", data=logits)
            f.attrs["num_experts"] = a.experts
            f.attrs["kind"] = a.kind
    else:
        os.makedirs(a.out, exist_ok=True)
        np.save(os.path.join(a.out, "experts.npy"), experts)
        np.save(os.path.join(a.out, "gates.npy"), gates)
        if logits is not None:
            np.save(os.path.join(a.out, "logits.npy"), logits)
    load = np.bincount(experts.reshape(a.steps, -1)[0], minlength=a.experts)
    print(f"make_trace.py: {a.kind} trace {experts.shape} -> {a.out} (step 0: hottest expert {int(load.argmax())} "
          f"carries {load.max() / load.mean():.2f}x the mean load)")


if __name__ == "__main__":
    main()
