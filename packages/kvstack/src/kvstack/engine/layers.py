"""The building blocks of the decoder families: RMSNorm, rotary embeddings, the SwiGLU MLP and
gpt-oss's mixture of experts. Plain torch, written to be read beside transformers' modeling code.

Parameter names match the Hugging Face checkpoints (``weight``, ``gate_proj``, ``experts.
gate_up_proj``, ...), so the loader maps tensor names one to one.

:class:`RMSNorm` and :class:`GatedMLP` can instead run through kv-kernels' fused ops
(``use_fused``: one launch for the residual add and the norm, one for the activation and the
product), chosen once when the model is built for its device (:meth:`~kvstack.engine.models.
CausalLM.use_fused_ops`): the torch code stays what the CPU runs and the parity tests hold.
"""

from __future__ import annotations

import torch
from kv_kernels.fused import gelu_tanh_and_mul, rms_norm, silu_and_mul
from torch import nn

# (rotary embeddings live in their own module; re-exported here, where they used to be)
from kvstack.engine.moe_grouped import GroupedExperts
from kvstack.engine.rotary import RotaryEmbedding, rope_inv_freq

__all__ = [
    "GatedMLP",
    "GptOssMoE",
    "Linear",
    "MixtralExpert",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "SparseMoE",
    "StackedLinear",
    "linear",
    "rope_inv_freq",
    "transposed",
]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype.

    transformers casts back *before* the weight multiply for Llama/Qwen3 and *after* it for
    gpt-oss; in float32 the two agree bit for bit, in bf16 they differ by one rounding.
    """

    def __init__(
        self, size: int, eps: float, *, weight_first: bool = False, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_first = weight_first  # gpt-oss order: (weight * x).to(dtype)
        # Gemma stores the gain's offset from one: x / rms(x) * (1 + weight), in float32 and
        # cast back after the multiply (the weight_first order), so offset goes with weight_first.
        self.offset = offset

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., size]`` normalized over its last dim, times ``weight`` (default: this
        norm's own ``[size]``). A ``weight`` of another shape that broadcasts against ``x`` lets
        one call serve rows with different weights (Qwen3's q and k heads, ``[Hq + Hkv, size]``):
        every row is normalized on its own, so the bits are those of one call per weight."""
        dtype = x.dtype
        w = self.weight if weight is None else weight
        if self.offset:
            w = w.float() + self.offset
        if dtype == torch.float32 and w.dtype == torch.float32:
            # One op instead of six (pow, mean, add, rsqrt, mul, mul): torch's rms_norm gives
            # the composite's bits on every shape here (test_layers.py holds it to them), and
            # in float32 both weight orders are the same products. A per-row weight broadcasts
            # in a multiply of its own (rms_norm takes a weight of the normalized shape only).
            if w.dim() == 1:
                return torch.rms_norm(x, (x.shape[-1],), w, self.eps)
            h = torch.rms_norm(x, (x.shape[-1],), None, self.eps)
            return h.mul_(w) if not torch.is_grad_enabled() else h * w
        h = _as_dtype(x, torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)  # a new tensor
        # The weight multiply goes in place where it keeps the dtype that ``w * h`` would have
        # (the same products: IEEE multiplication commutes): one activation-sized allocation
        # fewer per norm, which on a prefill step is a megabyte of fresh pages each.
        if self.weight_first:
            return _as_dtype(_mul_weight(h, w), dtype)
        return _mul_weight(_as_dtype(h, dtype), w)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)`` for ``x``, ``residual`` ``[T, size]``: a
        sublayer's output joins the residual stream, which is then normed for the next sublayer
        (vLLM's ``norm(x, residual)``). The sum is written over ``residual``, and the fused
        version writes the normed rows over ``x``: the caller hands both over."""
        residual.add_(x)  # the stream's own tensor: one allocation fewer per sublayer
        return self(residual), residual

    def use_fused(self, impl: str | None) -> None:
        """Run :meth:`forward` and :meth:`add_norm` through kv-kernels' ``rms_norm`` (``impl``:
        its ``"auto"``, ``"triton"`` or ``"reference"``; ``None``: back to the torch code).

        The instance's methods are rebound, so a call costs no branch on the choice. The fused
        op adds in float32 and rounds the sum once to the input dtype (what ``add_`` gives), and
        rounds the normed row where this module does (before the gain, or after it with
        ``weight_first``); only its float32 sum of squares may differ in order, so bf16 results
        agree to a rounding and float32 ones to a few ulps."""
        for name in ("forward", "add_norm"):
            self.__dict__.pop(name, None)
        if impl is None:
            return
        self._impl = impl
        self.forward = self._fused_forward  # type: ignore[method-assign]
        self.add_norm = self._fused_add_norm  # type: ignore[method-assign]

    def _fused_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        # x [T, size], or [T, H, size] with a per-head weight [H, size] (Qwen3's q/k norms)
        w = self._parameters["weight"] if weight is None else weight
        assert w is not None
        out = rms_norm(
            x, w, self.eps, weight_offset=self.offset, weight_first=self.weight_first,
            impl=self._impl,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    def _fused_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One launch that reads x and residual once and writes h over residual and y over x;
        # torch's add_ and bf16 norm are 9 launches (cast, pow, mean, add, rsqrt, mul, cast,
        # gain), each a pass over the rows.
        w = self._parameters["weight"]
        assert w is not None
        y, h = rms_norm(
            x, w, self.eps, residual=residual, out=x, residual_out=residual,
            weight_offset=self.offset, weight_first=self.weight_first, impl=self._impl,
        )  # fmt: skip
        return y, h


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the dispatch when it is a no-op (float32 models: a few dozen calls
    per decode step, each a microsecond of host time)."""
    return x if x.dtype == dtype else x.to(dtype)


def _mul_weight(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * h`` for a tensor ``h`` the caller owns (in place when the result keeps its dtype)."""
    if torch.promote_types(w.dtype, h.dtype) == h.dtype:
        return h.mul_(w)
    return w * h


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """``nn.functional.linear``, given a zero bias where it has none: the same values (``x @ W.T
    + 0``; bitwise equal on the engine's shapes), one OpenMP region fewer. Without a bias the CPU
    matmul clears the output in a parallel pass of its own before the product, and on a busy
    machine each region of all threads waits for a time slice of the slowest one (kvstack's
    engine benchmark, 2 shared cores: 2 regions per decode linear, 1 with the bias).

    A 2-D CPU input goes straight to ``addmm(bias, x, W.T)``, the call ``nn.functional.linear``
    makes there (so the same bits), with ``weight_t`` (``weight.t()``, kept by the caller) saving
    the transpose's dispatch: one op fewer per linear, 17 per decode step of a 4-layer model."""
    if x.device.type == "cpu":
        if bias is None:
            bias = _zeros(weight.shape[0], weight.dtype, weight.device)
        if x.dim() == 2:
            return torch.addmm(bias, x, weight.t() if weight_t is None else weight_t)
    return nn.functional.linear(x, weight, bias)


def transposed(
    cache: tuple[torch.Tensor, torch.Tensor] | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, weight.t())`` from ``cache`` when it still belongs to this very ``weight`` (the
    same tensor object over the same memory: a replaced parameter, or one whose ``.data`` was
    swapped by ``.to()`` or an assignment, gets a new view), else made anew."""
    if cache is not None and cache[0] is weight and cache[1].data_ptr() == weight.data_ptr():
        return cache
    return weight, weight.t()


_ZEROS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(n, dtype=dtype, device=device)
    return z


class Linear(nn.Linear):
    """``nn.Linear`` without its random init: every weight comes from a checkpoint (or the caller
    fills it), so drawing Kaiming-uniform numbers first would only cost time on big models.
    Runs through :func:`linear`."""

    _weight_t: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read through ``_parameters`` (nn.Module.__getattr__ costs a microsecond a lookup).
        params = self._parameters
        weight = params["weight"]
        assert weight is not None
        kept = transposed(self._weight_t, weight)
        if kept is not self._weight_t:  # nn.Module.__setattr__ is slow: set only on change
            self._weight_t = kept
        return linear(x, weight, params["bias"], kept[1])


class StackedLinear:
    """Linears that read the same input, run as one matmul.

    Their weights (and biases) are stacked as row blocks of one tensor, and each linear's
    parameters become views of its block: the names, shapes and values the checkpoint gave are
    unchanged, an in-place edit of a parameter edits the stack, and no memory is doubled. One
    ``[T, in] @ [in, sum(out)]`` matmul costs one call instead of one per linear, which is most of
    a small model's decode step; each output column is the same dot product either way.

    A parameter replaced since (``load_state_dict(assign=True)``, a new ``Parameter``, a move to
    another device) no longer lives in the stack: :meth:`__call__` then returns ``None`` and the
    caller runs the linears one by one, so a stale stack is never used.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("StackedLinear: the linears must all have a bias or all have none")
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])  # [sum(out), in]
            self.bias = (
                None
                if linears[0].bias is None
                else torch.cat([lin.bias for lin in linears if lin.bias is not None])
            )
        self.weight_t = self.weight.t()  # the stack is this object's own: never replaced
        for i, (lin, w) in enumerate(zip(linears, self.weight.split(self.sizes), strict=True)):
            lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
            if self.bias is not None:
                b = self.bias.split(self.sizes)[i]
                assert lin.bias is not None
                lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
        self._ptrs = self._param_ptrs()

    def _param_ptrs(self) -> tuple[int, ...]:
        # Read through ``_parameters``, not attribute access: nn.Module.__getattr__ costs a
        # microsecond a lookup, and this runs on every call (8 per decode step of a 4-layer model).
        return tuple(
            p.data_ptr()
            for lin in self.linears
            for p in (lin._parameters["weight"], lin._parameters["bias"])
            if p is not None
        )

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Each linear's output (column views of one result), or ``None`` if the parameters
        left the stack."""
        out = self.fused(x)
        return None if out is None else list(out.split(self.sizes, dim=-1))

    def fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """The one result ``[..., sum(sizes)]`` (linear ``i``'s output in the columns after the
        first ``i`` linears'), or ``None`` if the parameters left the stack."""
        if self._param_ptrs() != self._ptrs:
            return None
        return linear(x, self.weight, self.bias, self.weight_t)


class GatedMLP(nn.Module):
    """Llama/Mistral/Qwen3 MLP: ``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or, for
    Gemma, the tanh-approximated GELU (GeGLU)."""

    def __init__(
        self, hidden: int, intermediate: int, *, bias: bool = False, act: str = "silu"
    ) -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"GatedMLP act={act!r} must be 'silu' or 'gelu_pytorch_tanh'")
        self.act = act
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: StackedLinear | None = None

    def stack_projections(self) -> None:
        """Run gate and up as one matmul (see :class:`StackedLinear`); call once weights are in."""
        self.gate_up = StackedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stack = self.gate_up
        both = stack.fused(x) if stack is not None else None
        if stack is not None and both is not None:  # column slices of the one result
            n = stack.sizes[0]
            gate, up = both[..., :n], both[..., n:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act != "silu":
            return self.down_proj(nn.functional.gelu(gate, approximate="tanh").mul_(up))
        if both is not None and not torch.is_grad_enabled():
            # silu(gate) * up written over gate's columns of the stacked result (this call's
            # own tensor): no activation-sized allocation at all (a prefill step's fresh
            # megabytes are page faults), and down_proj reads the strided columns in place.
            return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))
        # silu(gate) * up, the product written into silu's fresh output: one allocation fewer.
        return self.down_proj(nn.functional.silu(gate).mul_(up))

    def use_fused(self, impl: str | None) -> None:
        """Run the activation and the product through kv-kernels' ``silu_and_mul`` /
        ``gelu_tanh_and_mul`` over the stacked gate/up output (``impl`` as
        :meth:`RMSNorm.use_fused`; ``None``: the torch code). One launch, float32 inside and one
        rounding, where torch takes two launches and rounds the activation before the product
        (so bf16 results differ by a rounding). Unstacked projections keep the torch code."""
        self.__dict__.pop("forward", None)
        if impl is None:
            return
        self._impl = impl
        self._act_and_mul = silu_and_mul if self.act == "silu" else gelu_tanh_and_mul
        self.forward = self._fused_forward  # type: ignore[method-assign]

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        stack = self.gate_up
        both = stack.fused(x) if stack is not None else None  # [T, 2 * intermediate]
        if both is None or both.dim() != 2:  # not stacked, or a parameter left the stack
            return GatedMLP.forward(self, x)
        return self.down_proj(self._act_and_mul(both, impl=self._impl))


class Router(nn.Module):
    """A mixture of experts' router: ``weight`` ``[E, hidden]`` (and, for DeepSeek-style routing,
    ``e_score_correction_bias`` ``[E]``, which moves the choice but not the weights)."""

    def __init__(self, hidden: int, num_experts: int, *, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts)) if correction_bias else None
        )


class MixtralExpert(nn.Module):
    """One Mixtral expert, named as the checkpoint stores it: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = Linear(hidden, intermediate, bias=False)
        self.w2 = Linear(intermediate, hidden, bias=False)
        self.w3 = Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)).mul_(self.w3(x)))


class SparseMoE(nn.Module):
    """A mixture of SwiGLU experts behind a router, three routing rules:

    - ``"mixtral"`` / ``"softmax_topk"`` (Mixtral, Qwen3-MoE): softmax over all experts in float32,
      top k, renormalized to sum to one when ``norm_topk_prob`` (always for Mixtral);
    - ``"grouped_sigmoid"`` (DeepSeek-V3, MiMo-V2-Flash): sigmoid scores; the choice uses the
      scores plus ``e_score_correction_bias``, restricted to the ``topk_group`` best of ``n_group``
      groups (a group scored by its two best experts); the weights are the chosen experts' plain
      scores, renormalized when ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``;
      ``shared_experts`` (one SwiGLU) is added for every token.

    Experts run one at a time over the tokens routed to them, in expert order, each output scaled
    by its weight and summed with ``index_add_``: transformers' loop, slow for big models and
    obvious to check.
    """

    def __init__(
        self,
        kind: str,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_intermediate: int = 0,
    ) -> None:
        super().__init__()
        if kind not in ("mixtral", "softmax_topk", "grouped_sigmoid"):
            raise ValueError(
                f"SparseMoE kind={kind!r} must be 'mixtral', 'softmax_topk' or 'grouped_sigmoid'"
            )
        self.kind = kind
        self.gate = Router(hidden, num_experts, correction_bias=kind == "grouped_sigmoid")
        self.experts = nn.ModuleList(
            MixtralExpert(hidden, intermediate)
            if kind == "mixtral"
            else GatedMLP(hidden, intermediate)
            for _ in range(num_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden, shared_intermediate) if shared_intermediate > 0 else None
        )
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob = norm_topk_prob or kind == "mixtral"
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        #: The experts stacked for one grouped matmul (:meth:`stack_experts`), or None: the loop.
        self.grouped: GroupedExperts | None = None

    def stack_experts(self) -> None:
        """Run the experts as grouped matmuls with no host sync from now on
        (:class:`~kvstack.engine.moe_grouped.GroupedExperts`; call once the weights are in).
        The loader does so where ``torch._grouped_mm`` serves the weights (CUDA, bf16 / fp16);
        parameters keep their names, shapes and values."""
        self.grouped = GroupedExperts(self.experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, expert ids [T, k])`` of tokens ``x`` ``[T, hidden]``."""
        logits = nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E]
        if self.kind != "grouped_sigmoid":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        bias = self.gate.e_score_correction_bias
        assert bias is not None
        scores = logits.sigmoid()  # [T, E]
        choice = scores + bias.float()
        t, g = x.shape[0], self.n_group
        group_scores = choice.view(t, g, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        keep = group_mask.unsqueeze(-1).expand(t, g, self.num_experts // g).reshape(t, -1)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        weights, ids = self.route(x)
        grouped = self.grouped
        if grouped is not None and grouped.intact():
            out = grouped(x, weights, ids)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)  # tokens routed to expert e, and which of k
            y = self.experts[e](x[tok])  # [t, hidden]
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))


class GptOssExperts(nn.Module):
    """Expert weights as the checkpoint stores them: ``x @ W`` (not ``W @ x``), gate and up
    interleaved in the last dim of ``gate_up_proj`` (even columns gate, odd columns up)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))


class GptOssMoE(nn.Module):
    """gpt-oss's MLP: route each token to its top-k experts (softmax over the k chosen logits),
    run each expert's clamped SwiGLU, sum the outputs weighted by the routing scores.

    The expert function, per token: ``gate = min(g, limit)``, ``up = clamp(u, -limit, limit)``,
    ``out = (up + 1) * gate * sigmoid(alpha * gate)``. One loop over experts that received tokens:
    slow for big models, obvious to check.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.router = GptOssRouter(hidden, num_experts)
        self.experts = GptOssExperts(hidden, intermediate, num_experts)
        self.top_k = top_k
        self.alpha = alpha
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)  # [T, E]
        top_logits, top_idx = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1)  # [T, k]
        out = torch.zeros_like(x)
        ex = self.experts
        for e in top_idx.unique().tolist():
            tok, slot = torch.where(top_idx == e)  # tokens routed to expert e, and which of k
            gate_up = x[tok] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]  # [t, 2I]
            gate = gate_up[:, 0::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * self.alpha)  # [t, I]
            y = act @ ex.down_proj[e] + ex.down_proj_bias[e]  # [t, hidden]
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out
