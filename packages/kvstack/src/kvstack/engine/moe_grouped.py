"""A mixture of experts' experts as two stacked weights, run by ``torch._grouped_mm`` with no
host sync (so a step with experts can be captured in a CUDA graph).

:class:`~kvstack.engine.layers.SparseMoE` runs its experts one at a time over the tokens routed
to each (transformers' loop): ``ids.unique().tolist()`` and ``torch.where`` stop the host for the
device once per layer, and the expert loop launches three matmuls per expert with tokens. Here
the (token, choice) pairs are sorted by expert on the device, each expert's rows are one group of
a grouped matmul (its row count from a device-side histogram), and the outputs are scaled and
summed back per token with ``index_add_``: shapes fixed by the token count, no data-dependent
host value anywhere.

The weights are stacked once at load, ``w13`` ``[E, 2I, H]`` (gate rows then up rows) and ``w2``
``[E, H, I]``; every expert's parameters become views of the stacks, so names, shapes and values
stay as the checkpoint gave them and no weight is held twice.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

__all__ = ["GroupedExperts", "grouped_mm_available"]


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` serves ``dtype`` on ``device`` (CUDA sm_90+, bf16 / fp16;
    the CPU keeps the expert loop, which is transformers' own order of operations)."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda":
        return False
    return dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(
        device
    ) >= (
        9,
        0,
    )


_Trio = tuple[nn.Linear, nn.Linear, nn.Linear]


def _projections(expert: nn.Module) -> _Trio:
    """(gate, up, down) linears of a SwiGLU expert (GatedMLP or Mixtral's w1 / w3 / w2)."""
    names = (
        ("gate_proj", "up_proj", "down_proj")
        if hasattr(expert, "gate_proj")
        else ("w1", "w3", "w2")
    )
    return cast(_Trio, tuple(getattr(expert, n) for n in names))


class GroupedExperts:
    """The experts of one layer, stacked (module docstring). ``experts``: SwiGLU experts with
    bias-free projections of equal shapes."""

    def __init__(self, experts: nn.ModuleList) -> None:
        projs = [_projections(e) for e in experts]
        gate0, _, down0 = projs[0]
        inter, hidden = gate0.weight.shape
        num = len(projs)
        w = gate0.weight
        if any(p.bias is not None for trio in projs for p in trio):
            raise ValueError("GroupedExperts: experts with biases are not supported")
        self.intermediate = inter
        self.w13 = torch.empty(num, 2 * inter, hidden, dtype=w.dtype, device=w.device)
        self.w2 = torch.empty(num, hidden, inter, dtype=down0.weight.dtype, device=w.device)
        with torch.no_grad():
            for e, (gate, up, down) in enumerate(projs):
                # copy, then point the parameter at the stack (the old storage is freed)
                self.w13[e, :inter].copy_(gate.weight)
                self.w13[e, inter:].copy_(up.weight)
                self.w2[e].copy_(down.weight)
                gate.weight = nn.Parameter(self.w13[e, :inter], requires_grad=False)
                up.weight = nn.Parameter(self.w13[e, inter:], requires_grad=False)
                down.weight = nn.Parameter(self.w2[e], requires_grad=False)
        # column-major [E, K, N] views, what _grouped_mm takes as its second operand
        self.w13_t = self.w13.transpose(1, 2)
        self.w2_t = self.w2.transpose(1, 2)
        # the first and last experts' (a check of every expert would cost 3E pointer reads a call)
        self._projs = [projs[0], projs[-1]]
        self._ptrs = self._param_ptrs(self._projs)
        self.act_and_mul: Any = None  # a fused silu(gate) * up over [T, 2I], else torch's

    @staticmethod
    def _param_ptrs(projs: list[_Trio]) -> tuple[int, ...]:
        # through _parameters: nn.Module.__getattr__ costs a microsecond a lookup
        return tuple(
            cast(torch.Tensor, p._parameters["weight"]).data_ptr() for trio in projs for p in trio
        )

    def intact(self) -> bool:
        """Whether the experts' parameters are still the stacks' views (a load_state_dict or
        ``.to()`` replaces them all; the first and last expert stand for the rest): when not,
        the stacks are stale and the caller loops over the experts instead."""
        return self._param_ptrs(self._projs) == self._ptrs

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for tokens ``x`` ``[T, H]``, routing
        ``weights`` ``[T, k]`` (float32) and ``ids`` ``[T, k]``; ``[T, H]`` in ``x``'s dtype."""
        k = ids.shape[1]
        num = self.w13.shape[0]
        flat = ids.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.zeros(num, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)  # group e's rows end at offs[e]
        tok = order // k  # [T * k] the token of each sorted row
        h = torch._grouped_mm(x.index_select(0, tok), self.w13_t, offs=offs)  # [T * k, 2I]
        if self.act_and_mul is not None:
            a = self.act_and_mul(h)
        else:
            n = self.intermediate
            a = nn.functional.silu(h[:, :n]).mul_(h[:, n:])
        y = torch._grouped_mm(a, self.w2_t, offs=offs)  # [T * k, H]
        y = (y * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)
