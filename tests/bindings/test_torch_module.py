"""Every parameter through every Python door, against torch.autograd.

kokkosmoe.torch.MoELayer (an nn.Module over the layer's own storage) on
synthetic Hugging Face checkpoints: its output, the input gradient and every
parameter gradient (router weight, this rank's routed experts, shared
experts) against a float64 PyTorch reference of the public definitions run
on all tokens in one process; get/set of every parameter by name and global
expert id, with the errors of bad values on every rank; an optimizer step
through the zero-copy parameters; and the expert-parallel run at this rank
count equal, bit for bit, to the same tokens in one process.

    mpiexec -n 4 /usr/bin/python3 -m pytest -q tests/bindings/test_torch_module.py
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import kokkosmoe as km  # noqa: E402  (after mpi4py: the layer uses its MPI)
from kokkosmoe.torch import MoELayer  # noqa: E402
from test_checkpoint_torch import FAMILIES, make_checkpoint, reference, deck  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SCRATCH = os.environ.get("KMOE_SCRATCH", ".")
TOKENS = 8


def checkpoint_and_deck(tag, family, algorithm, tokens=TOKENS, extra="", nodes=None, router=""):
    directory = os.path.join(SCRATCH, "torch_module", tag)
    deck_path = directory + ".toml"
    if RANK == 0:
        cfg, w = make_checkpoint(directory, family, "F32", False)
        deck(deck_path, directory, FAMILIES[family]["layer"], algorithm,
             nodes if nodes is not None else (2 if SIZE % 2 == 0 else 1), tokens=tokens, extra=extra, router=router)
    else:
        cfg, w = None, None
    cfg, w = COMM.bcast((cfg, w), root=0)
    return directory, deck_path, cfg, w


def leaves(w):
    """The reference's weights as float64 leaves that collect gradients."""
    def leaf(a):
        return torch.tensor(a, dtype=torch.float64, requires_grad=True)
    out = {"router": leaf(w["router"]), "experts": [[leaf(m) for m in e] for e in w["experts"]]}
    if "bias" in w:
        out["bias"] = torch.tensor(w["bias"], dtype=torch.float64)
    if "shared" in w:
        out["shared"] = [leaf(m) for m in w["shared"]]
    return out


def grad_of(leaf):
    """A reference leaf's gradient (zeros for an expert no token chose)."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def close(a, b, what):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30), err_msg=what)


@pytest.mark.parametrize("family,algorithm", [("deepseek_v3", "hierarchical"), ("mixtral", "flat"), ("qwen3_moe", "hierarchical_dedup")])
def test_module_gradients_equal_torch_autograd(family, algorithm):
    tag = f"grads_{family}_np{SIZE}"
    _, deck_path, cfg, w = checkpoint_and_deck(tag, family, algorithm)
    d = cfg["hidden_size"]
    x_all = np.random.default_rng(3).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
    dy_all = np.random.default_rng(4).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
    mine = slice(RANK * TOKENS, (RANK + 1) * TOKENS)

    moe = MoELayer(deck=deck_path)
    x = torch.tensor(x_all[mine], requires_grad=True)
    y = moe(x)
    (y * torch.tensor(dy_all[mine])).sum().backward()

    ref = leaves(w)
    xt = torch.tensor(x_all, dtype=torch.float64, requires_grad=True)
    yt = reference(xt, cfg, ref)
    yt.backward(torch.tensor(dy_all, dtype=torch.float64))

    close(y.detach(), yt.detach()[mine], f"{tag}: forward")
    close(x.grad, xt.grad[mine], f"{tag}: input gradient")
    close(moe.router_weight.grad, grad_of(ref["router"]), f"{tag}: router weight gradient")
    for q, e in enumerate(moe.local_experts):
        for name, r in zip(("expert_gate", "expert_up", "expert_down"), ref["experts"][int(e)]):
            close(getattr(moe, name).grad[q], grad_of(r), f"{tag}: {name} gradient of expert {e}")
    if "shared" in w:
        for name, r in zip(("shared_gate", "shared_up", "shared_down"), ref["shared"]):
            close(getattr(moe, name).grad[0], grad_of(r), f"{tag}: {name} gradient")
    # The same gradients through the layer's own doors (every expert, on every rank).
    layer = moe.layer
    close(layer.get_gradient("router_weight"), grad_of(ref["router"]), f"{tag}: get_gradient(router_weight)")
    for e in range(layer.parameter_count("expert_down")):
        close(layer.get_gradient("expert_down", e), grad_of(ref["experts"][e][2]), f"{tag}: get_gradient(expert_down, {e})")
    assert np.array_equal(layer.gradient_view("router_weight"), moe.router_weight.grad.numpy())
    moe.close()


def test_every_parameter_gets_and_sets_by_global_expert_id():
    tag = f"params_np{SIZE}"
    _, deck_path, cfg, w = checkpoint_and_deck(tag, "deepseek_v3", "flat")
    E, d = len(w["experts"]), cfg["hidden_size"]
    with km.Layer(deck=deck_path) as layer:
        assert layer.parameter_shape("router_weight") == (E, d)
        assert layer.parameter_count("expert_gate") == E and layer.parameter_count("shared_gate") == 1
        assert np.array_equal(layer.get_parameter("router_weight"), w["router"])
        assert np.array_equal(layer.get_parameter("correction_bias"), w["bias"])
        for e in range(E):
            for k, name in enumerate(("expert_gate", "expert_up", "expert_down")):
                assert np.array_equal(layer.get_parameter(name, e), w["experts"][e][k]), (name, e)
        for k, name in enumerate(("shared_gate", "shared_up", "shared_down")):
            assert np.array_equal(layer.get_parameter(name, 0), w["shared"][k])

        # New values through set_parameter: the forward follows them.
        rng = np.random.default_rng(21)
        new = {"router": (rng.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32),
               "bias": (0.1 * rng.standard_normal(E)).astype(np.float32),
               "experts": [list(m) for m in w["experts"]], "shared": list(w["shared"])}
        layer.set_parameter("router_weight", 0, new["router"])
        layer.set_parameter("correction_bias", 0, new["bias"])
        for e in (0, E // 2, E - 1):
            mats = [(rng.standard_normal(m.shape) / np.sqrt(m.shape[1])).astype(np.float32) for m in w["experts"][e]]
            new["experts"][e] = mats
            for name, m in zip(("expert_gate", "expert_up", "expert_down"), mats):
                layer.set_parameter(name, e, m if e in layer.local_experts() else None)
        new["shared"][2] = (0.5 * w["shared"][2]).astype(np.float32)
        layer.set_parameter("shared_down", 0, new["shared"][2])
        for e in (0, E // 2, E - 1):
            assert np.array_equal(layer.get_parameter("expert_up", e), new["experts"][e][1])
        x_all = np.random.default_rng(5).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
        mine = slice(RANK * TOKENS, (RANK + 1) * TOKENS)
        y = layer.forward(np.ascontiguousarray(x_all[mine]))
        close(y, reference(torch.tensor(x_all, dtype=torch.float64), cfg, new).numpy()[mine], "forward after set_parameter")

        # Bad values are the same error on every rank and change nothing.
        before = layer.get_parameter("router_weight")
        with pytest.raises(km.Error, match="ranks 0 and 1 pass different values" if SIZE > 1 else "value 3 is nan"):
            v = before.copy()
            if SIZE > 1:
                v[0, 0] += RANK
            else:
                v.flat[3] = np.nan
            layer.set_parameter("router_weight", 0, v)
        with pytest.raises(km.Error, match=r"expert_gate index %d is outside 0..%d" % (E, E - 1)):
            layer.set_parameter("expert_gate", E, w["experts"][0][0])
        with pytest.raises(km.Error, match=r"values are \(3, 3\)"):
            layer.set_parameter("router_weight", 0, np.zeros((3, 3), np.float32))
        with pytest.raises(ValueError, match="unknown parameter 'router'"):
            layer.get_parameter("router")
        layer.forward(np.ascontiguousarray(x_all[mine]))
        layer.backward(np.ascontiguousarray(x_all[mine]), np.ones((TOKENS, d), np.float32))
        with pytest.raises(km.Error, match="has no gradient"):
            layer.get_gradient("correction_bias")
        assert np.array_equal(layer.get_parameter("router_weight"), before)


def test_an_optimizer_step_on_the_module_is_the_layers_next_forward():
    tag = f"sgd_np{SIZE}"
    _, deck_path, cfg, w = checkpoint_and_deck(tag, "mixtral", "flat")
    d = cfg["hidden_size"]
    x_all = np.random.default_rng(7).standard_normal((SIZE * TOKENS, d)).astype(np.float32)
    mine = slice(RANK * TOKENS, (RANK + 1) * TOKENS)
    moe = MoELayer(deck=deck_path)
    lr = 0.05
    opt = torch.optim.SGD(moe.parameters(), lr=lr)
    x = torch.tensor(x_all[mine])
    (moe(x) ** 2).sum().backward()
    router_grad = moe.router_weight.grad.clone()
    expert_grads = {int(e): [getattr(moe, n).grad[q].clone() for n in ("expert_gate", "expert_up", "expert_down")]
                    for q, e in enumerate(moe.local_experts)}
    opt.step()
    # Every rank's expert gradients, to rebuild the stepped weights everywhere.
    all_grads = {}
    for part in COMM.allgather({e: [g.numpy() for g in gs] for e, gs in expert_grads.items()}):
        all_grads.update(part)
    # The layer's weights are the stepped parameters (the same memory) ...
    layer = moe.layer
    assert np.array_equal(layer.get_parameter("router_weight"), moe.router_weight.detach().numpy())
    stepped = {"router": layer.get_parameter("router_weight"),
               "experts": [[layer.get_parameter(n, e) for n in ("expert_gate", "expert_up", "expert_down")]
                           for e in range(len(w["experts"]))]}
    # ... which are w - lr * grad (torch's float32 update) ...
    close(stepped["router"], w["router"] - lr * router_grad.numpy().astype(np.float64), "stepped router weight")
    for e in range(len(w["experts"])):
        for k in range(3):
            close(stepped["experts"][e][k], w["experts"][e][k] - lr * all_grads[e][k].astype(np.float64), f"stepped expert {e}")
    assert not np.array_equal(stepped["router"], w["router"])
    # ... and the next forward runs on them.
    y = moe(x).detach().numpy()
    close(y, reference(torch.tensor(x_all, dtype=torch.float64), cfg, stepped).numpy()[mine], "forward after an SGD step")
    moe.close()


def test_expert_parallel_equals_one_process_bitwise():
    """Output, input gradient and every parameter gradient at this rank count
    are the bits of the same tokens in one process: 64-token blocks for the
    router and shared-expert gradient sums, the generic router GEMM (a BLAS
    sgemm's blocking, and so its rounding, depends on the row count) and the
    grouped expert runner."""
    per = 64
    extra = "[train]\nreproducible_shared = true\ngradient_block = 64\n"
    router = 'gemm = "generic"'
    directory, deck_path, cfg, w = checkpoint_and_deck(f"bitwise_np{SIZE}", "deepseek_v3", "flat", tokens=per, extra=extra,
                                                       router=router)
    d = cfg["hidden_size"]
    x_all = np.random.default_rng(9).standard_normal((SIZE * per, d)).astype(np.float32)
    dy_all = np.random.default_rng(10).standard_normal((SIZE * per, d)).astype(np.float32)
    mine = slice(RANK * per, (RANK + 1) * per)

    def run(layer, x, dy):
        y = layer.forward(np.ascontiguousarray(x))
        dx = layer.backward(np.ascontiguousarray(x), np.ascontiguousarray(dy))
        grads = {n: [layer.get_gradient(n, i) for i in range(layer.parameter_count(n))]
                 for n in km.PARAMETERS if n != "correction_bias" and layer.parameter_count(n) > 0}
        return y, dx, grads

    with km.Layer(deck=deck_path) as layer:
        y, dx, grads = run(layer, x_all[mine], dy_all[mine])
    ys, dxs = COMM.gather(y, root=0), COMM.gather(dx, root=0)
    problems = []
    if RANK == 0:
        single = os.path.join(SCRATCH, "torch_module", f"bitwise_single_np{SIZE}.toml")
        deck(single, directory, FAMILIES["deepseek_v3"]["layer"], "flat", 1, tokens=SIZE * per, extra=extra, router=router)
        with km.Layer(deck=single, comm=MPI.COMM_SELF) as one:
            y1, dx1, grads1 = run(one, x_all, dy_all)
        if not np.array_equal(np.concatenate(ys), y1):
            problems.append("output")
        if not np.array_equal(np.concatenate(dxs), dx1):
            problems.append("input gradient")
        for n, tensors in grads1.items():
            for i, g in enumerate(tensors):
                if not np.array_equal(grads[n][i], g):
                    problems.append(f"{n} {i} (largest difference {np.abs(grads[n][i] - g).max():.3g})")
    problems = COMM.bcast(problems, root=0)
    assert not problems, f"np{SIZE} differs from one process in: " + ", ".join(problems)
