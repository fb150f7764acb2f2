"""Hugging Face checkpoints through the layer, against a PyTorch reference.

Synthetic checkpoints (NumPy arrays written as safetensors: F32, BF16, F8_E4M3
with 128 x 128 block scales, single and sharded) of DeepSeek-V3 (sigmoid
scores, correction bias for selection only, group limit with top-2 group
scores, normalization, route scale, a shared MLP), Qwen3-MoE (softmax,
normalized top-k) and Mixtral (softmax, renormalized top-2) are loaded by
a deck (`[model] checkpoint`, `layer`) and run on every rank; the output and
the input gradient of every rank's tokens are compared with a PyTorch
implementation of the public definitions, run on all tokens in one process.

    mpiexec -n 2 /usr/bin/python3 -m pytest -q tests/bindings/test_checkpoint_torch.py
"""

import json
import os
import struct

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import kokkosmoe as km  # noqa: E402  (after mpi4py: the layer uses its MPI)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SCRATCH = os.environ.get("KMOE_SCRATCH", ".")
TOKENS = 8  # per rank


# ---- safetensors from NumPy ---------------------------------------------------

def bf16_bits(a):
    """float32 -> bf16 bits, round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_table():
    """float value of every E4M3 code (NaN for S.1111.111)."""
    v = np.zeros(256, dtype=np.float32)
    for c in range(256):
        s, e, m = (c >> 7) & 1, (c >> 3) & 0xF, c & 7
        if e == 15 and m == 7:
            v[c] = np.nan
        elif e == 0:
            v[c] = m / 8.0 * 2.0 ** -6
        else:
            v[c] = (1 + m / 8.0) * 2.0 ** (e - 7)
        if s:
            v[c] = -v[c]
    return v


def write_safetensors(path, tensors):
    """tensors: name -> (dtype name, array of the stored values)."""
    header, blobs, at = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def stored(name, w, dtype, rng):
    """The tensors holding weight w as dtype, and the weight they hold (fp32)."""
    if dtype == "F32":
        return {name: ("F32", w.astype(np.float32))}, w.astype(np.float32)
    if dtype == "BF16":
        bits = bf16_bits(w)
        return {name: ("BF16", bits)}, bf16_value(bits)
    # F8_E4M3: codes of magnitude up to 1.75 (finite), one scale per 128 x 128 block.
    table = e4m3_table()
    codes = rng.choice([c for c in range(256) if abs(table[c]) <= 1.75 and not np.isnan(table[c])], size=w.shape).astype(np.uint8)
    rows, cols = w.shape
    br, bc = (rows + 127) // 128, (cols + 127) // 128
    scales = (2.0 ** rng.integers(-6, -3, size=(br, bc))).astype(np.float32)
    full = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:rows, :cols]
    return {name: ("F8_E4M3", codes), name + "_scale_inv": ("F32", scales)}, (table[codes] * full).astype(np.float32)


# ---- the models -------------------------------------------------------------------

FAMILIES = {
    "deepseek_v3": dict(config={"model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 160, "n_routed_experts": 16,
                                "num_experts_per_tok": 4, "moe_intermediate_size": 48, "n_shared_experts": 2,
                                "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 4, "topk_group": 2,
                                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
                                "topk_method": "noaux_tc"},
                        layer=1, prefix="model.layers.1.mlp.", names=("gate_proj", "up_proj", "down_proj"), router="gate"),
    "qwen3_moe": dict(config={"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 96, "num_experts": 8,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 40, "norm_topk_prob": True,
                              "decoder_sparse_step": 1, "mlp_only_layers": []},
                      layer=1, prefix="model.layers.1.mlp.", names=("gate_proj", "up_proj", "down_proj"), router="gate"),
    "mixtral": dict(config={"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "num_local_experts": 8,
                            "num_experts_per_tok": 2, "intermediate_size": 56},
                    layer=0, prefix="model.layers.0.block_sparse_moe.", names=("w1", "w3", "w2"), router="gate"),
}


def make_checkpoint(directory, family, dtype, sharded, seed=11, bias_shift=0.0):
    """Writes config.json and the layer's tensors; returns the fp32 weights they hold."""
    spec = FAMILIES[family]
    cfg = spec["config"]
    rng = np.random.default_rng(seed)
    d = cfg["hidden_size"]
    E = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    ffn = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    p = spec["prefix"]
    g_name, u_name, d_name = spec["names"]
    tensors, weights = {}, {"experts": []}
    router = (rng.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32)
    tensors[p + "gate.weight"] = ("F32", router)
    weights["router"] = router
    if cfg.get("topk_method") == "noaux_tc":
        bias = (0.2 * rng.standard_normal(E) + bias_shift).astype(np.float32)
        tensors[p + "gate.e_score_correction_bias"] = ("F32", bias)
        weights["bias"] = bias

    def mlp(prefix, width):
        out = []
        for nm, shape in ((g_name, (width, d)), (u_name, (width, d)), (d_name, (d, width))):
            w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            t, held = stored(prefix + nm + ".weight", w, dtype, rng)
            tensors.update(t)
            out.append(held)
        return out

    for e in range(E):
        weights["experts"].append(mlp(p + "experts.%d." % e, ffn))
    if cfg.get("n_shared_experts"):
        weights["shared"] = mlp(p + "shared_experts.", cfg["n_shared_experts"] * ffn)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(tensors)
    if not sharded:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    else:  # three shards, experts spread over them
        shards = [names[i::3] for i in range(3)]
        wmap = {}
        for i, part in enumerate(shards):
            fname = "model-%05d-of-00003.safetensors" % (i + 1)
            write_safetensors(os.path.join(directory, fname), {n: tensors[n] for n in part})
            wmap.update({n: fname for n in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wmap}, f)
    return cfg, weights


def top(values, k):
    """Indices of the k largest, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def reference(x, cfg, w, group_mask="exclude"):
    """The MoE block of the public definitions, in PyTorch (float64);
    group_mask: the dropped groups' experts excluded (-inf, DeepSeek's
    reference code) or zeroed (0.0, Hugging Face transformers)."""
    family = cfg["model_type"]
    dt = torch.float64

    def _t(a):  # a weight: a torch tensor as it is (a leaf that wants gradients), or an array
        return a if torch.is_tensor(a) else torch.tensor(a, dtype=dt)

    W = _t(w["router"])
    logits = x @ W.T
    k = cfg["num_experts_per_tok"]
    E = W.shape[0]
    if family == "deepseek_v3":
        s = torch.sigmoid(logits)
        sel = s + _t(w["bias"])  # the bias chooses, it does not weigh
        G, kg = cfg["n_group"], cfg["topk_group"]
        group_scores = sel.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_scores.topk(kg, dim=-1).indices, True)
        fill = float("-inf") if group_mask == "exclude" else 0.0
        sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), fill)
        idx = top(sel, k)
        gates = s.gather(1, idx)
        if cfg["norm_topk_prob"]:
            gates = gates / gates.sum(-1, keepdim=True)
        gates = gates * cfg["routed_scaling_factor"]
    else:
        s = torch.softmax(logits, dim=-1)
        idx = top(s, k)
        gates = s.gather(1, idx)
        if family == "mixtral" or cfg.get("norm_topk_prob"):
            gates = gates / gates.sum(-1, keepdim=True)

    def swiglu(h, mats):
        g, u, dn = (_t(m) for m in mats)
        return (torch.nn.functional.silu(h @ g.T) * (h @ u.T)) @ dn.T

    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            y[t] = y[t] + gates[t, j] * swiglu(x[t:t + 1], w["experts"][int(idx[t, j])])[0]
    if "shared" in w:
        y = y + swiglu(x, w["shared"])
    return y


def deck(path, checkpoint, layer, algorithm, nodes, group_mask="exclude", tokens=TOKENS, extra="", router=""):
    text = f"""
[run]
steps = 1
warmup = 0
seed = 5

[model]
checkpoint = "{checkpoint}"
layer = {layer}
dtype = "fp32"
payload = "fp32"
return_payload = "fp32"

[router]
group_mask = "{group_mask}"
{router}

[tokens]
per_rank = {tokens}
source = "router"

[topology]
layout = "virtual"
nodes = {nodes}

[exchange]
algorithm = "{algorithm}"

[experts]
runner = "grouped"
{extra}
"""
    with open(path, "w") as f:
        f.write(text)


CASES = [
    ("deepseek_v3", "F32", False, "flat"),
    ("deepseek_v3", "BF16", True, "hierarchical"),
    ("deepseek_v3", "F8_E4M3", False, "flat"),
    ("qwen3_moe", "BF16", False, "flat"),
    ("mixtral", "F32", True, "hierarchical"),
]


@pytest.mark.parametrize("family,dtype,sharded,algorithm", CASES)
def test_checkpoint_layer_equals_torch(family, dtype, sharded, algorithm):
    tag = f"{family}_{dtype}_{'sharded' if sharded else 'single'}_np{SIZE}"
    directory = os.path.join(SCRATCH, "checkpoints", tag)
    deck_path = os.path.join(SCRATCH, "checkpoints", tag + ".toml")
    if RANK == 0:
        cfg, w = make_checkpoint(directory, family, dtype, sharded)
        deck(deck_path, directory, FAMILIES[family]["layer"], algorithm, 2 if SIZE % 2 == 0 else 1)
    else:
        cfg, w = None, None
    cfg, w = COMM.bcast((cfg, w), root=0)
    d = cfg["hidden_size"]
    x_all = np.random.default_rng(3).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
    dy_all = np.random.default_rng(4).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
    mine = slice(RANK * TOKENS, (RANK + 1) * TOKENS)
    with km.Layer(deck=deck_path) as layer:
        x = np.ascontiguousarray(x_all[mine])
        y = layer.forward(x)
        dx = layer.backward(x, np.ascontiguousarray(dy_all[mine]))
    xt = torch.tensor(x_all, dtype=torch.float64, requires_grad=True)
    yt = reference(xt, cfg, w)
    yt.backward(torch.tensor(dy_all, dtype=torch.float64))
    y_ref = yt.detach().numpy()[mine]
    dx_ref = xt.grad.numpy()[mine]
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5 * scale, err_msg=f"{tag}: forward")
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=1e-5 * np.abs(dx_ref).max(), err_msg=f"{tag}: input gradient")


@pytest.mark.parametrize("group_mask", ["exclude", "zero"])
def test_group_masks_differ_and_each_equals_its_reference(group_mask):
    """A negative correction bias: where a kept expert's score plus bias is
    below zero, the zeroed dropped groups' experts (0.0) win over it."""
    tag = f"mask_{group_mask}_np{SIZE}"
    directory = os.path.join(SCRATCH, "checkpoints", f"negative_bias_np{SIZE}")
    deck_path = os.path.join(SCRATCH, "checkpoints", tag + ".toml")
    if RANK == 0:
        cfg, w = make_checkpoint(directory, "deepseek_v3", "F32", False, bias_shift=-0.8)
        deck(deck_path, directory, 1, "flat", 1, group_mask)
    else:
        cfg, w = None, None
    cfg, w = COMM.bcast((cfg, w), root=0)
    x_all = np.random.default_rng(3).standard_normal((SIZE * TOKENS, cfg["hidden_size"])).astype(np.float32)
    mine = slice(RANK * TOKENS, (RANK + 1) * TOKENS)
    with km.Layer(deck=deck_path) as layer:
        y = layer.forward(np.ascontiguousarray(x_all[mine]))
    xt = torch.tensor(x_all, dtype=torch.float64)
    y_ref = reference(xt, cfg, w, group_mask).numpy()[mine]
    other = reference(xt, cfg, w, "zero" if group_mask == "exclude" else "exclude").numpy()
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5 * scale, err_msg=f"{tag}: forward")
    # The case where the two differ is in the data (all tokens together).
    assert np.abs(reference(xt, cfg, w, group_mask).numpy() - other).max() > 1e-2 * scale


def test_a_deck_that_contradicts_the_config_is_refused():
    directory = os.path.join(SCRATCH, "checkpoints", f"contradiction_np{SIZE}")
    deck_path = directory + ".toml"
    if RANK == 0:
        make_checkpoint(directory, "mixtral", "F32", False)
        deck(deck_path, directory, 0, "flat", 1)
        with open(deck_path) as f:
            text = f.read()
        with open(deck_path, "w") as f:
            f.write(text.replace('layer = 0\n', 'layer = 0\ntop_k = 3\n'))
    COMM.Barrier()
    with pytest.raises(km.Error, match=r"model.top_k.*= 3 contradicts the checkpoint's config.json \(num_experts_per_tok = 2\)"):
        km.Layer(deck=deck_path)
