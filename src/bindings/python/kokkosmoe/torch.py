"""KokkosMoE layers as PyTorch modules.

    import torch
    from kokkosmoe.torch import MoELayer

    moe = MoELayer(deck="inputs/quickstart.toml")          # one rank per process (mpiexec)
    y = moe(x)                                              # x: [tokens, hidden] float32, this rank's rows
    loss = ((y - target) ** 2).mean()
    loss.backward()                                         # x.grad, moe.router_weight.grad, moe.expert_gate.grad, ...
    torch.optim.SGD(moe.parameters(), lr=1e-2).step()       # updates the layer's own weights in place

The module's parameters are the layer's own storage on this rank, without
copies (CPU builds): `router_weight` [E, d], the routed experts this rank
holds, `expert_gate` / `expert_up` [L, f, d] and `expert_down` [L, d, f]
(local slot q holds global expert `local_experts[q]`), and the shared
experts `shared_gate` / `shared_up` [S, fs, d] and `shared_down` [S, d, fs]
when the layer has them; the correction bias is the buffer
`correction_bias` [E] (it selects, it has no gradient). An optimizer step on
them changes the layer's next forward.

forward and backward are collective over the layer's communicator: every
rank calls them in the same order. The backward gives x's gradient and every
parameter's: the router weight's and the shared experts' are summed over the
ranks (the same on every rank, as a data-parallel all-reduce would leave
them), a routed expert's is summed over its replicas, so every copy of an
expert takes the same optimizer step. Backward needs an fp32 layer; a bf16
layer is forward-only (its parameters do not require gradients).
"""

import numpy as np
import torch

from . import Layer

__all__ = ["MoELayer"]

_ROUTED = ("expert_gate", "expert_up", "expert_down")
_SHARED = ("shared_gate", "shared_up", "shared_down")


def _as_tensor(array):
    """A torch tensor over a NumPy array's memory (uint16 bf16 bits become bfloat16)."""
    if array.dtype == np.uint16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class _MoEFunction(torch.autograd.Function):
    """The layer as one autograd node: inputs x and the module's parameters."""

    @staticmethod
    def forward(ctx, x, module, *params):
        rows = x.detach()
        if module._bf16:
            out = module.layer.forward(rows.contiguous().view(torch.int16).numpy().view(np.uint16))
        else:
            out = module.layer.forward(rows.contiguous().numpy())
        ctx.module = module
        ctx.save_for_backward(rows)
        return _as_tensor(out)

    @staticmethod
    def backward(ctx, dout):
        module = ctx.module
        (rows,) = ctx.saved_tensors
        dx = module.layer.backward(rows.contiguous().numpy(), dout.detach().to(torch.float32).contiguous().numpy())
        grads = [torch.from_numpy(module.layer.gradient_view(name).copy()) for name in module._param_names]
        return (torch.from_numpy(dx), None, *grads)


class MoELayer(torch.nn.Module):
    """A KokkosMoE layer (kokkosmoe.Layer: a deck, or keywords) as an nn.Module."""

    def __init__(self, deck=None, comm=None, **config):
        super().__init__()
        self.layer = Layer(deck=deck, comm=comm, **config)
        self._bf16 = self.layer.shape["dtype"] == "bf16"
        self._param_names = ["router_weight"]
        self.router_weight = torch.nn.Parameter(_as_tensor(self.layer.parameter_view("router_weight")),
                                                requires_grad=not self._bf16)
        for name in _ROUTED:
            setattr(self, name, torch.nn.Parameter(_as_tensor(self.layer.parameter_view(name)), requires_grad=not self._bf16))
            self._param_names.append(name)
        if self.layer.parameter_count("shared_gate") > 0:
            for name in _SHARED:
                setattr(self, name, torch.nn.Parameter(_as_tensor(self.layer.parameter_view(name)), requires_grad=not self._bf16))
                self._param_names.append(name)
        if self.layer.parameter_count("correction_bias") > 0:
            self.register_buffer("correction_bias", _as_tensor(self.layer.parameter_view("correction_bias")))
        self.local_experts = self.layer.local_experts()

    def forward(self, x):
        if x.dim() != 2 or x.shape[1] != self.layer.shape["hidden"]:
            raise ValueError(f"MoELayer: x must be [tokens, {self.layer.shape['hidden']}], not {list(x.shape)}")
        want = torch.bfloat16 if self._bf16 else torch.float32
        if x.dtype != want:
            raise TypeError(f"MoELayer: the layer computes in {self.layer.shape['dtype']}: x must be {want}, not {x.dtype}")
        params = [getattr(self, name) for name in self._param_names]
        return _MoEFunction.apply(x, self, *params)

    def close(self):
        """Collective: frees the layer (its parameters' storage with it)."""
        self.layer.close()
