#!/usr/bin/python3
"""One MoE block in PyTorch eager and in KokkosMoE, on the same weights.

    PYTHONPATH=build/python /usr/bin/python3 scripts/bench_vs_torch.py [--hidden 1024 --experts 16 --top-k 2 --ffn 512]

The block is Qwen3-MoE's (softmax router, normalized top-k, SwiGLU experts):
PyTorch runs it as Hugging Face transformers does in eager mode (one masked
gather, three matmuls and an index_add per chosen expert); KokkosMoE loads
the same weights from a safetensors checkpoint through a deck ([model]
checkpoint) and runs its layer on one rank. One thread each (torch's intra-op
threads, and Kokkos' when its backend is threaded). For T = 1, 8, 64 and 512
tokens, fp32 and bf16, one line per case:

    BENCH name=vs_torch_T64_fp32 tokens=64 dtype=fp32 ... torch_s=... ours_s=... speedup=... ratio=...

speedup = torch time / ours, ratio = ours / torch (the BENCH convention:
ours over the baseline measured in the same run); times are medians of
--reps calls after a warm-up; max_rel_diff compares the two outputs (relative
to the largest output value); route_flips counts tokens whose top-k differs
between torch's logits, rounded to the input dtype, and FP32 logits (this
library's router), and max_rel_diff_same_routes compares the other tokens. A
benchmark, not a test: absolute times depend on the machine.
"""

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before Kokkos starts (threaded backends)
os.environ.setdefault("OMP_PROC_BIND", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kokkosmoe as km  # noqa: E402


def bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_checkpoint(directory, weights, cfg, dtype):
    """config.json and model.safetensors of one Qwen3-MoE layer (layer 0)."""
    header, blobs, at = {}, [], 0
    for name, w in weights.items():
        arr = bf16_bits(w) if dtype == "bf16" else np.ascontiguousarray(w, dtype=np.float32)
        b = arr.tobytes()
        header[name] = {"dtype": "BF16" if dtype == "bf16" else "F32", "shape": list(w.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)


def torch_block(x, router, experts, k):
    """Hugging Face's eager sparse MoE block (Qwen3-MoE, Mixtral)."""
    logits = x @ router.T
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    gates, idx = torch.topk(probs, k, dim=-1)
    gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(idx, num_classes=len(experts)).permute(2, 1, 0)
    for e in torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten().tolist():
        slot, tok = torch.where(mask[e])
        g, u, dn = experts[e]
        h = x[tok]
        y = (torch.nn.functional.silu(h @ g.T) * (h @ u.T)) @ dn.T
        out.index_add_(0, tok, y * gates[tok, slot, None])
    return out


def median_time(f, reps):
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    if min(a.hidden, a.experts, a.top_k, a.ffn, a.reps, *a.tokens) < 1 or a.top_k > a.experts:
        sys.exit("bench_vs_torch: sizes must be >= 1 and --top-k <= --experts")
    torch.set_num_threads(1)
    d, E, k, f = a.hidden, a.experts, a.top_k, a.ffn
    rng = np.random.default_rng(1)
    weights = {"model.layers.0.mlp.gate.weight": (rng.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32)}
    for e in range(E):
        for nm, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            weights[f"model.layers.0.mlp.experts.{e}.{nm}.weight"] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": d, "num_experts": E, "num_experts_per_tok": k,
           "moe_intermediate_size": f, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    print(f"bench_vs_torch: d={d} experts={E} top_k={k} ffn={f}, one thread; torch {torch.__version__}, "
          f"KokkosMoE {km.version()} ({km.build_configuration()['kokkos_execution_space']})", flush=True)
    with tempfile.TemporaryDirectory(prefix="kmoe-vs-torch-") as tmp:
        for dtype in a.dtypes:
            tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
            ck = os.path.join(tmp, dtype)
            os.makedirs(ck)
            write_checkpoint(ck, weights, cfg, dtype)
            held = {n: torch.tensor(w).to(tdt) for n, w in weights.items()}  # what the checkpoint holds (bf16-rounded)
            router = held["model.layers.0.mlp.gate.weight"]
            experts = [[held[f"model.layers.0.mlp.experts.{e}.{nm}.weight"] for nm in ("gate_proj", "up_proj", "down_proj")]
                       for e in range(E)]
            for T in a.tokens:
                deck = os.path.join(tmp, f"{dtype}_{T}.toml")
                with open(deck, "w") as fd:
                    fd.write(f'[run]\nsteps = 1\nwarmup = 0\n[model]\ncheckpoint = "{ck}"\nlayer = 0\ndtype = "{dtype}"\n'
                             f'payload = "{dtype}"\nreturn_payload = "{dtype}"\n[tokens]\nper_rank = {T}\n'
                             f'[topology]\nlayout = "virtual"\nnodes = 1\n')
                x = torch.tensor(np.random.default_rng(T).standard_normal((T, d)).astype(np.float32)).to(tdt)
                with km.Layer(deck=deck) as layer:
                    rows = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
                    out = np.empty_like(rows)
                    ours = median_time(lambda: layer.forward(rows, out), a.reps)
                with torch.no_grad():
                    ref = torch_block(x, router, experts, k)
                    theirs = median_time(lambda: torch_block(x, router, experts, k), a.reps)
                y = (out.astype(np.uint32) << 16).view(np.float32) if dtype == "bf16" else out
                r = ref.to(torch.float32).numpy()
                diff = float(np.abs(y - r).max() / max(np.abs(r).max(), 1e-30))
                # Tokens whose top-k set differs between torch's logits (in
                # x's dtype) and FP32 logits of the same inputs (this
                # library's router): their rows go to other experts, so the
                # difference on the other tokens is reported apart.
                with torch.no_grad():
                    mine_k = torch.topk(x.float() @ router.float().T, k, dim=-1).indices.sort(-1).values
                    their_k = torch.topk((x @ router.T).float(), k, dim=-1).indices.sort(-1).values
                flipped = (mine_k != their_k).any(-1).numpy()
                keep = ~flipped
                diff_kept = float(np.abs(y[keep] - r[keep]).max() / max(np.abs(r).max(), 1e-30)) if keep.any() else 0.0
                print(f"BENCH name=vs_torch_T{T}_{dtype} tokens={T} dtype={dtype} d={d} experts={E} top_k={k} ffn={f} "
                      f"torch_s={theirs:.6g} ours_s={ours:.6g} speedup={theirs / ours:.3f} max_rel_diff={diff:.2g} "
                      f"route_flips={int(flipped.sum())} max_rel_diff_same_routes={diff_kept:.2g} "
                      f"ratio={ours / theirs:.3f}", flush=True)


if __name__ == "__main__":
    main()
