"""KokkosMoE in Python: expert-parallel Mixture-of-Experts layers.

    import numpy as np
    import kokkosmoe as km

    layer = km.Layer(deck="inputs/quickstart.toml")        # or km.Layer(hidden=64, experts=8, top_k=2, ...)
    rows = layer.deck_rows(0)                               # this rank's rows of the deck's first step
    out = layer.forward(rows)                               # [tokens, hidden] float32 (uint16 for bf16 bits)
    dx = layer.backward(rows, out - target)                 # input gradient (fp32 layers)
    print(layer.last_step()["seconds"])
    layer.close()

MPI and Kokkos are started on import unless they run already (mpi4py
started MPI, say) and stopped at exit. Calls on a layer are collective over
its communicator (MPI_COMM_WORLD, or the mpi4py communicator given as
comm=): every rank makes them in the same order. A failed call raises
kokkosmoe.Error with the library's message and status, on every rank for
collective calls. NumPy arrays are used in place: C-contiguous float32 rows
(fp32 layers) or uint16 rows holding bf16 bits (bf16 layers).

Parameters (PARAMETERS), one tensor per index: router_weight [E, d] and
correction_bias [E] (index 0), expert_gate / expert_up [f, d] and
expert_down [d, f] by global expert id, shared_gate / shared_up / shared_down
by shared expert. kokkosmoe.torch.MoELayer is the layer as a torch.nn.Module.
"""

import atexit
import json

from . import _kokkosmoe as _k

__all__ = ["Error", "Layer", "PARAMETERS", "eplb", "version", "build_configuration", "initialize", "finalize"]

#: The parameter names of a layer (kmoe_parameter order).
PARAMETERS = ("router_weight", "correction_bias", "expert_gate", "expert_up", "expert_down",
              "shared_gate", "shared_up", "shared_down")

#: Status codes of kmoe.h.
SUCCESS, INVALID_ARGUMENT, NOT_INITIALIZED, INPUT, RUNTIME, UNAVAILABLE, BUFFER_TOO_SMALL = range(7)


class Error(RuntimeError):
    """A KokkosMoE call failed: the message, and the kmoe.h status."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


_k._set_error_type(Error)
_layers = []


def initialize():
    """MPI (unless running) and Kokkos (unless running); done on import."""
    _k.initialize()


def finalize():
    """Closes every open layer, then stops what initialize() started."""
    for ref in list(_layers):
        layer = ref
        if layer is not None:
            layer.close()
    _layers.clear()
    if _k.is_initialized():
        _k.finalize()


def version():
    return _k.version()


def build_configuration():
    """The build as a dict (version, git hash, Kokkos, HDF5, NCCL, cuBLAS)."""
    return json.loads(_k.build_configuration_json())


def eplb(loads, slots, ranks, nodes=1, groups=1):
    """EPLB placement of len(loads) experts on `slots` slots over `ranks`
    ranks on `nodes` nodes: (slot_expert, slot_rank) arrays."""
    return _k.eplb(loads, slots, ranks, nodes, groups)


class Layer:
    """An MoE layer on the ranks of `comm` (None: MPI_COMM_WORLD; an mpi4py
    communicator otherwise), from a deck file or from keywords: hidden,
    experts, top_k, ffn, shared_experts, dtype ("fp32", "bf16"),
    tokens_per_rank, algorithm, transport, score, payload and return_payload
    (rows on the dispatch and combine wires), nodes (virtual nodes; 0: the
    machine's), seed."""

    def __init__(self, deck=None, comm=None, **config):
        if deck is not None and config:
            raise TypeError("Layer: give a deck or keywords, not both")
        self._layer = _k.Layer.from_deck(str(deck), comm) if deck is not None else _k.Layer.from_config(config, comm)
        _layers.append(self)

    def close(self):
        """Collective: frees the layer (also done at exit)."""
        if self._layer is not None:
            self._layer.close()
            self._layer = None
        if self in _layers:
            _layers.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def shape(self):
        """hidden, experts, top_k, dtype, tokens_per_rank."""
        return self._layer.shape

    def forward(self, hidden, out=None):
        """Collective: the layer applied to this rank's rows [tokens, hidden];
        the result in `out` (same shape and dtype) or a new array."""
        return self._layer.forward(hidden, out)

    def backward(self, hidden, dout):
        """Collective: the backward of the last forward, which ran on
        `hidden`: returns the gradient with respect to hidden given dout
        (the gradient with respect to the output); the parameter gradients
        stay in the layer (gradient_norm()). fp32 layers."""
        return self._layer.backward(hidden, dout)

    def gradient_norm(self):
        """Collective: L2 norm of the last backward's parameter gradients."""
        return self._layer.gradient_norm()

    def deck_rows(self, step=0):
        """This rank's rows of step `step` of the deck."""
        return self._layer.deck_rows(step)

    def digest(self, rows):
        """Collective: content digest of every rank's rows (kmoe-layer's output_digest)."""
        return self._layer.digest(rows)

    def last_step(self):
        """The last forward on this rank: ledger, stage seconds, tasks (a dict)."""
        return json.loads(self._layer.last_step_json())

    def topology(self):
        """Every rank's host, node, relay and peer slots (a dict)."""
        return json.loads(self._layer.topology_json())

    def placement(self):
        """(slot_expert, slot_rank) arrays of the placement."""
        return self._layer.placement()

    def save_weights(self, path):
        """Collective: the routed experts' weights to an HDF5 file."""
        self._layer.save_weights(str(path))

    def load_weights(self, path):
        """Collective: the routed experts' weights from an HDF5 file."""
        self._layer.load_weights(str(path))

    # ---- parameters (see PARAMETERS) ----

    def parameter_count(self, name):
        """How many tensors parameter `name` has (0 where the layer has none)."""
        return self._layer.parameter_count(name)

    def parameter_shape(self, name):
        """The shape of one tensor of parameter `name`."""
        return tuple(self._layer.parameter_shape(name))

    def get_parameter(self, name, index=0):
        """Collective: tensor `index` of parameter `name` (float32 copy)."""
        return self._layer.get_parameter(name, index)

    def set_parameter(self, name, index, values):
        """Collective: sets tensor `index` of `name` from float32-convertible
        values (every rank holding a copy passes the same; None on ranks
        holding no copy of a routed expert)."""
        self._layer.set_parameter(name, index, values)

    def get_gradient(self, name, index=0):
        """Collective: the gradient of tensor `index` of `name` from the last backward."""
        return self._layer.get_gradient(name, index)

    def local_experts(self):
        """The global expert id of each of this rank's routed slots."""
        return self._layer.local_experts()

    def parameter_view(self, name):
        """This rank's storage of parameter `name`, without a copy: router_weight
        [E, d], correction_bias [E], expert_* [slots, rows, cols] (this rank's
        slots, local_experts() order), shared_* [shared, rows, cols]; float32
        (uint16 bf16 bits in bf16 layers). Writes are the layer's weights."""
        return self._layer.parameter_view(name)

    def gradient_view(self, name):
        """This rank's gradient storage of `name` (float32, no copy), laid out
        as parameter_view's and refilled by every backward."""
        return self._layer.gradient_view(name)


initialize()
atexit.register(finalize)
