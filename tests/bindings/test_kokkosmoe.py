"""The Python package under pytest, at any rank count (every test is a
collective sequence: each rank runs the same calls in the same order).

    mpiexec -n 2 python3 -m pytest -q tests/bindings/test_kokkosmoe.py
"""

import os

import numpy as np
import pytest

import kokkosmoe as km

SOURCE = os.environ.get("KMOE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SCRATCH = os.environ.get("KMOE_SCRATCH", ".")
DECK = os.path.join(SOURCE, "inputs", "quickstart.toml")


def small(**kw):
    config = dict(hidden=32, experts=8, top_k=2, ffn=48, tokens_per_rank=16, seed=7)
    config.update(kw)
    return km.Layer(**config)


def test_version_and_build():
    assert km.version().count(".") == 2
    build = km.build_configuration()
    assert build["version"] == km.version()
    assert {"kokkos_flavor", "hdf5", "nccl", "cublas"} <= set(build)


def test_forward_is_deterministic_and_in_place():
    with small() as layer:
        assert layer.shape == {"hidden": 32, "experts": 8, "top_k": 2, "dtype": "fp32", "tokens_per_rank": 16}
        rows = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
        a = layer.forward(rows)
        out = np.zeros_like(rows)
        b = layer.forward(rows, out=out)
        assert b is out or np.shares_memory(b, out)
        assert np.array_equal(a, out)
        assert np.isfinite(a).all() and np.abs(a).sum() > 0
        step = layer.last_step()
        assert step["tokens"] == 16 and step["routes"]["attempted"] == 32
        assert step["ledger"]["dispatch"]["useful_rows"] >= 0
        assert {"router", "dispatch", "experts", "combine", "total"} <= set(step["seconds"])


def test_bf16_rows_are_uint16_bits():
    with small(dtype="bf16") as layer:
        rows = (np.linspace(-1, 1, 16 * 32, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).reshape(16, 32)
        out = layer.forward(rows)
        assert out.dtype == np.uint16 and out.shape == (16, 32)
        as_float = (out.astype(np.uint32) << 16).view(np.float32)
        assert np.isfinite(as_float).all()


def test_errors_are_raised_on_every_rank():
    with small() as layer:
        rows = np.zeros((16, 32), dtype=np.float32)
        with pytest.raises(km.Error, match="the layer computes in fp32") as e:
            layer.forward(rows.astype(np.uint16))
        assert e.value.status == km.INVALID_ARGUMENT
        with pytest.raises(km.Error, match="rows of 31 elements"):
            layer.forward(np.zeros((16, 31), dtype=np.float32))
        with pytest.raises(km.Error, match="float32 .* or uint16"):
            layer.forward(np.zeros((16, 32), dtype=np.float64))
        with pytest.raises(km.Error, match="out must be"):
            layer.forward(rows, out=np.zeros((8, 32), dtype=np.float32))
        with pytest.raises(km.Error, match="C-contiguous"):
            layer.forward(np.zeros((32, 16), dtype=np.float32).T)
        # The layer still works afterwards.
        assert layer.forward(rows).shape == (16, 32)
    with pytest.raises(km.Error, match="model.top_k") as e:
        small(top_k=99)
    assert e.value.status == km.INPUT
    with pytest.raises(km.Error, match="nonexistent"):
        km.Layer(deck="/nonexistent/deck.toml")
    with pytest.raises(TypeError, match="unknown keyword"):
        km.Layer(widht=3)


def test_deck_layer_rows_and_digest():
    with km.Layer(deck=DECK) as layer:
        rows = layer.deck_rows(0)
        assert rows.shape == (layer.shape["tokens_per_rank"], layer.shape["hidden"])
        out = layer.forward(rows)
        d1 = layer.digest(out)
        d2 = layer.digest(layer.forward(rows))
        assert d1 == d2 and len(d1) == 16
        topo = layer.topology()
        assert "ranks" in topo or len(topo) > 0
        experts, ranks = layer.placement()
        assert len(experts) == len(ranks) and experts.min() >= 0


def test_weights_round_trip():
    """The routed experts' weights through HDF5: another layer's experts
    change the output; the layer's own bring it back bitwise."""
    mine = os.path.join(SCRATCH, "python_weights.h5")
    theirs = os.path.join(SCRATCH, "python_weights_other.h5")
    rows = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
    with small() as layer:
        before = layer.forward(rows)
        layer.save_weights(mine)
    with small(seed=99) as other:
        other.save_weights(theirs)
    with small() as layer:
        layer.load_weights(theirs)
        assert not np.array_equal(layer.forward(rows), before)
        layer.load_weights(mine)
        assert np.array_equal(layer.forward(rows), before)
        with pytest.raises(km.Error, match="nonexistent"):
            layer.load_weights("/nonexistent/weights.h5")


def test_backward_matches_a_finite_difference():
    """<dx, v> against the central difference of <dout, forward(rows)> along v
    (fp32 rows on the wires, so that the difference sees no bf16 rounding)."""
    with small(payload="fp32", return_payload="fp32") as layer:
        rows = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
        dout = np.cos(np.arange(16 * 32, dtype=np.float32)).reshape(16, 32)
        layer.forward(rows)
        dx = layer.backward(rows, dout)
        assert dx.shape == rows.shape and layer.gradient_norm() > 0
        v = np.sin(np.arange(16 * 32, dtype=np.float32) * 0.7).reshape(16, 32)
        h = 1e-3
        plus = float((dout.astype(np.float64) * layer.forward(rows + h * v)).sum())
        minus = float((dout.astype(np.float64) * layer.forward(rows - h * v)).sum())
        fd = (plus - minus) / (2 * h)
        assert abs(float((dx.astype(np.float64) * v).sum()) - fd) <= 2e-3 * (abs(fd) + 0.05)
        with pytest.raises(km.Error, match="differ in shape"):
            layer.backward(rows, dout[:8])


def test_eplb_replicates_the_hot_expert():
    experts, ranks = km.eplb([10, 1, 1, 1, 1, 1, 1, 4], slots=16, ranks=4, nodes=2)
    assert (experts == 0).sum() >= 2 and set(ranks) == {0, 1, 2, 3}
    with pytest.raises(km.Error):
        km.eplb([1, 2, 3], slots=5, ranks=4)


def test_mpi4py_communicator():
    mpi4py = pytest.importorskip("mpi4py.MPI")
    with small(comm=mpi4py.COMM_WORLD) as layer:
        assert layer.forward(np.ones((16, 32), dtype=np.float32)).shape == (16, 32)
