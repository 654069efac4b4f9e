"""The per-layer half of the backend contract: :class:`AttentionImpl` (a layer's head sizes,
scales, window and sinks; its cache write and forward), the checks of those parameters, and the
checked manager-block -> kernel-block view of a cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from kv_spec import KVCacheLayout, KVQuantMode, LayoutOrder, to_torch_dtype

from kv_backends.config import AttentionConfig

if TYPE_CHECKING:
    from kv_backends.base import AttentionMetadata

__all__ = [
    "AttentionImpl",
    "LayerParams",
    "PlainCacheWrite",
    "check_config_and_layout",
    "kernel_block_view",
    "kernel_split_problem",
]

# The manager-block -> kernel-block view rule lives in kv-spec, once:
# KVCacheLayout.kernel_block_problem (kernel block divides block_size, an order whose block
# stride is block_size x the token stride, no scale plane, no page padding). Here it becomes a
# reason string (validate: the whole rule given a layout, else the part a config can tell) and
# a checked view (kv_kernels.kernel_block_view, which also checks the tensor's strides).


def kernel_split_problem(
    order: str,
    block_size: int,
    kernel_block_size: int,
    layout: KVCacheLayout | None = None,
) -> str | None:
    """Why ``block_size``-token blocks in ``order`` cannot be viewed as kernel blocks of
    ``kernel_block_size`` tokens, or ``None`` when they can (or need no split).

    kv-spec's rule (:meth:`kv_spec.KVCacheLayout.kernel_block_problem`). With ``layout`` it is
    asked of that layout (scale plane and page padding included); without one, of an unpadded,
    plane-free cache of ``order`` and ``block_size`` (what an :class:`AttentionConfig` tells).
    """
    if layout is None:
        layout = _probe_layout(order, block_size)
    return layout.kernel_block_problem(kernel_block_size)


def _probe_layout(order: str, block_size: int) -> KVCacheLayout:
    """The smallest unpadded, plane-free layout of ``order`` and ``block_size``: the facts a
    config gives kv-spec's kernel-block rule (it reads nothing else)."""
    return KVCacheLayout(
        order=LayoutOrder.parse(order),
        num_layers=1,
        num_blocks=1,
        num_kv_heads=1,
        block_size=block_size,
        head_size=1,
        head_size_v=1,
        dtype="float32",
    )


def _as_scale(
    value: torch.Tensor | float | None,
    device: torch.device | None = None,
    *,
    field: str = "scale",
) -> torch.Tensor | None:
    """A float32 scale tensor (on ``device`` when given). A Python number becomes a 0-d tensor
    made by a fill on ``device``: no host->device copy, so it is safe under CUDA-graph capture."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{field}={value!r} must be a float, a tensor or None")
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _check_finite(name: str, t: torch.Tensor | None, *, positive: bool = False) -> None:
    # Host check at construction only (never on the per-step path).
    if t is None or t.device.type == "meta":
        return
    tf = t.detach().float()
    if not bool(torch.isfinite(tf).all()):
        raise ValueError(
            f"{name} has non-finite values ({tf.flatten()[:8].tolist()}); pass finite values"
        )
    if positive and not bool((tf > 0).all()):
        raise ValueError(
            f"{name}={tf.flatten()[:8].tolist()} must be > 0 (the cache stores x / scale)"
        )


def _normalize_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@dataclass(frozen=True)
class LayerParams:
    """A layer's constant tensors on one device, float32: made once, reused every step (so a
    CUDA-graph capture never sees a host->device copy)."""

    sinks: torch.Tensor | None  # [num_q_heads]
    alibi_slopes: torch.Tensor | None  # [num_q_heads]
    k_scale: torch.Tensor | None  # [] or [num_kv_heads]
    v_scale: torch.Tensor | None  # [] or [num_kv_heads]


class PlainCacheWrite(NamedTuple):
    """What :meth:`AttentionImpl.plain_cache_write` reports: the ``impl`` and ``error_flag`` its
    ``reshape_and_cache`` call passes (the other arguments are the write's own and the impl's
    ``layout``; no scales)."""

    impl: str
    error_flag: torch.Tensor | None


class AttentionImpl:
    """One layer's attention over the paged cache. Everything per layer lives on the instance.

    ``device`` (optional) places sinks, ALiBi slopes and K/V scales on that device at
    construction; without it they move on the first forward on a device (run one eager step
    before capturing a CUDA graph, as every engine does) and stay there.
    """

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_config_and_layout(config, layout)
        _check_layout_matches(config, layout)
        self.config = config
        self.layout = layout
        self.num_q_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_size = config.head_size
        self.head_size_v = config.head_size_v
        self.kernel_block_size = config.kernel_block_size
        self.scale = _check_scale(scale, config.head_size)
        self.sliding_window = config.sliding_window
        self.softcap = config.softcap
        self.causal = config.causal
        _check_head_vector("sinks", sinks, config.has_sinks, config.num_q_heads, "has_sinks")
        _check_head_vector(
            "alibi_slopes", alibi_slopes, config.use_alibi, config.num_q_heads, "use_alibi"
        )
        self.sinks = sinks
        self.alibi_slopes = alibi_slopes
        self.k_scale = _as_scale(k_scale, field="k_scale")
        self.v_scale = _as_scale(v_scale, field="v_scale")
        _check_finite("k_scale", self.k_scale, positive=True)
        _check_finite("v_scale", self.v_scale, positive=True)
        if config.kv_quant == "fp8_per_tensor":
            if config.mla:
                _check_latent_scales(self.k_scale, self.v_scale)
            elif self.k_scale is None or self.v_scale is None:
                raise ValueError("kv_quant=fp8_per_tensor needs k_scale and v_scale")
        self._params: dict[torch.device, LayerParams] = {}
        # Per-step checks compare against these (no dtype-name parsing on the hot path).
        self._q_dtype = to_torch_dtype(config.dtype)
        self._cache_dtype = to_torch_dtype(layout.dtype)
        self._cache_shape = torch.Size(
            (layout.num_blocks, layout.num_kv_heads, layout.block_size, layout.content_size)
        )
        self._kernel_layout: KVCacheLayout | None = None
        dev = _normalize_device(device)
        if dev is not None:
            self.device_params(dev)

    # -- helpers -----------------------------------------------------------------------------

    def device_params(self, device: torch.device) -> LayerParams:
        """Sinks, slopes and scales as float32 on ``device``, made on first use and cached."""
        params = self._params.get(device)
        if params is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{type(self).__name__}: the layer's sinks/scales are not on {device} yet and "
                    "cannot be copied during CUDA-graph capture; pass device= to make_impl or run "
                    "one eager step before capturing"
                )
            params = LayerParams(
                sinks=_as_scale(self.sinks, device),
                alibi_slopes=_as_scale(self.alibi_slopes, device),
                k_scale=_as_scale(self.k_scale, device),
                v_scale=_as_scale(self.v_scale, device),
            )
            self._params[device] = params
        return params

    def scales(
        self, layer: object, device: torch.device | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """K/V scales: the layer's (dynamic quant) when it has them, else the impl's; on
        ``device`` (from the per-device cache) when given.

        An MLA layer's latent has one scale: ``(k_scale, None)``, which is what its kernels take
        (the latent written as ``x / k_scale``, K and V read back with it); a layer object that
        carries a ``v_scale`` must carry its ``k_scale`` tensor itself there."""
        k = getattr(layer, "k_scale", None) if layer is not None else None
        v = getattr(layer, "v_scale", None) if layer is not None else None
        if self.config.mla:
            if v is not None and v is not k:
                raise ValueError(
                    f"layer.v_scale={v!r} on an MLA layer is not its k_scale: the latent row is "
                    "stored once, as x / k_scale, and V is read from it; give the layer no "
                    "v_scale (or its k_scale object itself)"
                )
            own_k = self.k_scale if device is None else self.device_params(device).k_scale
            return (_as_scale(k, device, field="layer.k_scale") if k is not None else own_k), None
        if device is None:
            own_k, own_v = self.k_scale, self.v_scale
        else:
            params = self.device_params(device)
            own_k, own_v = params.k_scale, params.v_scale
        return (
            _as_scale(k, device, field="layer.k_scale") if k is not None else own_k,
            _as_scale(v, device, field="layer.v_scale") if v is not None else own_v,
        )

    def check_forward_inputs(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        if q.dim() != 3 or q.shape[1] != self.num_q_heads or q.shape[2] != self.head_size:
            raise ValueError(
                f"q has shape {tuple(q.shape)}; expected [num_tokens, {self.num_q_heads}, {self.head_size}]"
            )
        if q.shape[0] < metadata.num_actual_tokens:
            raise ValueError(
                f"q has {q.shape[0]} tokens but the batch has num_actual_tokens={metadata.num_actual_tokens}"
            )
        if q.dtype != self._q_dtype:
            raise ValueError(f"q has dtype {q.dtype}; this layer computes in {self.config.dtype}")
        self.check_cache(kv_cache)

    def forward_q_shape(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[int, int, int]:
        """:meth:`check_forward_inputs` on the hot path: ``q``'s ``(T, Hq, D)``, each tensor
        attribute read once and dtypes compared by identity (torch dtypes are singletons); any
        failing test runs the full check, which raises the named error. A backend's ``forward``
        calls this once per layer per step (issue 32: the backends' host path)."""
        try:
            t, hq, d = q.shape
        except ValueError:  # not [T, Hq, D]: check_forward_inputs names it
            t = hq = d = -1
        if (
            hq != self.num_q_heads
            or d != self.head_size
            or t < metadata.num_actual_tokens
            or q.dtype is not self._q_dtype
            or kv_cache.dtype is not self._cache_dtype
            or kv_cache.shape != self._cache_shape
        ):
            self.check_forward_inputs(q, kv_cache, metadata)
        return t, hq, d

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.shape != self._cache_shape:
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; expected the [B, H, N, C] layer view "
                f"{tuple(self._cache_shape)} (kv_kernels.layer_view(storage, layout, layer))"
            )
        if kv_cache.dtype != self._cache_dtype:
            raise ValueError(
                f"kv_cache has dtype {kv_cache.dtype}; the layout says {self.layout.dtype}"
            )

    def kernel_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, KVCacheLayout]:
        """The cache as kernel blocks (``[B*k, H, N/k, C]``) with a matching layout (the layout
        is made once per impl: it is per-step host work otherwise)."""
        kbs = self.kernel_block_size
        assert kbs is not None
        if kbs == self.layout.block_size:
            return kv_cache, self.layout
        if self._kernel_layout is None:
            view, self._kernel_layout = kernel_block_view(kv_cache, self.layout, kbs)
            return view, self._kernel_layout
        return _strided_kernel_view(kv_cache, self.layout.block_size, kbs), self._kernel_layout

    def empty_output(
        self, q: torch.Tensor, out: torch.Tensor | None, *, zeroed: bool = True
    ) -> torch.Tensor:
        """``out`` checked against ``[T, Hq, Dv]`` in q's dtype, or a new such tensor: zeros, or
        uninitialized with ``zeroed=False`` for a caller that writes every row itself."""
        shape = (q.shape[0], self.num_q_heads, self.head_size_v)
        if out is None:
            return (torch.zeros if zeroed else torch.empty)(shape, dtype=q.dtype, device=q.device)
        if tuple(out.shape) != shape or out.dtype != q.dtype:
            raise ValueError(
                f"out has shape {tuple(out.shape)} / {out.dtype}; expected {shape} / {q.dtype}"
                + self._out_note
            )
        return out

    #: Appended to :meth:`empty_output`'s error (what the output holds, where it is unusual).
    _out_note: ClassVar[str] = ""

    def do_kv_cache_update(
        self,
        layer: object,
        key: torch.Tensor,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write ``key`` ``[T, H, D]`` and ``value`` ``[T, H, Dv]`` to their slots (``-1`` skipped).

        Every backend writes through kv-kernels' ``reshape_and_cache`` (the layout says where K, V
        and inline scales go); the layer's own scales win over the impl's. ``value`` is ``None``
        only for MLA caches (one latent row per token); slots past the cache are counted in
        :meth:`_error_flag`'s counter where the backend keeps one.
        """
        from kv_kernels.reshape_and_cache import reshape_and_cache

        self.check_cache(kv_cache)
        k_scale, v_scale = self.scales(layer, kv_cache.device)
        reshape_and_cache(
            key,
            value,
            kv_cache,
            slot_mapping,
            self.layout,
            k_scale,
            v_scale,
            impl=self.cache_write_impl(),
            error_flag=self._error_flag(kv_cache.device),
        )

    def plain_cache_write(self, device: torch.device) -> PlainCacheWrite | None:
        """How :meth:`do_kv_cache_update` writes on ``device`` (a ``layer=None`` call) when the
        write is exactly kv-kernels' ``reshape_and_cache(key, value, kv_cache, slot_mapping,
        self.layout, impl=..., error_flag=...)`` with no scales: an unquantized, non-MLA cache
        written by this base method, not a subclass's own. ``None`` otherwise (a quantized cache
        needs its scales, an MLA cache stores latent rows, an override writes its own way).

        For a caller that fuses work into the write (kv-kernels' ``fused.rope_and_cache``: RoPE
        and the write in one launch) and must write the same bytes, counted in the same flag.
        Call it outside CUDA-graph capture: it makes the impl's tensors on ``device``."""
        if type(self).do_kv_cache_update is not AttentionImpl.do_kv_cache_update:
            return None
        if self.layout.kv_quant is not KVQuantMode.NONE or self.layout.is_mla or self.config.mla:
            return None
        if self.k_scale is not None or self.v_scale is not None:
            return None  # (reshape_and_cache refuses scales on an unquantized cache)
        self.device_params(device)  # (the error flag of a backend that keeps one)
        return PlainCacheWrite(self.cache_write_impl(), self._error_flag(device))

    def cache_write_impl(self) -> str:
        """The ``reshape_and_cache`` implementation: ``"auto"`` (Triton on CUDA, torch on CPU)."""
        return "auto"

    def _error_flag(self, device: torch.device) -> torch.Tensor | None:
        """The int32 device counter the kernels add bad metadata to (``None``: not counted; the
        TRITON backends keep one under ``check_metadata=True``)."""
        return None

    def warmup(
        self,
        kv_cache: torch.Tensor,
        *,
        block_table_width: int | None = None,
        block_table_stride: int | None = None,
    ) -> dict[str, float]:
        """Build the kernels this layer's steps launch before the first request, through the
        cache's null block 0 (``kv_kernels.warmup``): seconds per launch, ``{}`` where this
        backend compiles nothing ahead (the torch reference, libraries that ship their
        kernels built). ``block_table_width`` / ``block_table_stride``: the columns and row
        pitch of the block tables the steps pass."""
        return {}

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over the cache; returns ``[T, Hq, Dv]`` (padding rows 0)."""
        raise NotImplementedError


def _check_latent_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An fp8 MLA latent's scales (construction only, on the host): ``k_scale`` is the latent
    row's one scale; ``v_scale`` is ``None`` or the same value (an engine may hand every layer a
    K and a V scale), never another one: V is the same stored row."""
    if k_scale is None:
        raise ValueError(
            "kv_quant=fp8_per_tensor on an MLA layer needs k_scale, the latent row's one scale "
            "(the cache stores latent / k_scale; K and V are read back with it); v_scale may be "
            "None or the same value"
        )
    if v_scale is None or v_scale.device.type == "meta":
        return
    k, v = k_scale.detach().float().cpu(), v_scale.detach().float().cpu()
    try:
        same = bool(torch.equal(*torch.broadcast_tensors(k, v)))
    except RuntimeError:
        same = False
    if not same:
        raise ValueError(
            f"v_scale={v.flatten()[:8].tolist()} differs from k_scale={k.flatten()[:8].tolist()} "
            "on an MLA layer: its latent row is stored once, as x / k_scale, and V is its first "
            "kv_lora_rank columns; pass v_scale=None (or k_scale's value)"
        )


def _check_scale(scale: object, head_size: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale={scale!r} must be a float or None (None = 1/sqrt(head_size))")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r} must be a finite float > 0 (None = 1/sqrt(head_size))")
    return float(scale)


def _check_head_vector(name: str, t: object, declared: bool, num_q_heads: int, flag: str) -> None:
    if declared != (t is not None):
        raise ValueError(
            f"config.{flag}={declared} but {name} is "
            f"{'given' if t is not None else 'None'}; pass a float [num_q_heads] tensor exactly "
            f"when config.{flag} is True"
        )
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a float tensor of shape ({num_q_heads},); got {type(t).__name__}"
        )
    if tuple(t.shape) != (num_q_heads,):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected ({num_q_heads},) = one value per query head"
        )
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; expected a float dtype")
    _check_finite(name, t)


def check_config_and_layout(config: object, layout: object) -> None:
    """The types of a constructor's ``config`` and ``layout`` (a ``TypeError`` naming the field,
    what came and what to pass): every later check reads their fields."""
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"config must be a kv_backends.AttentionConfig, got {type(config).__name__}; build "
            "one with AttentionConfig(...) or AttentionConfig.from_spec(spec, ...)"
        )
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(
            f"layout must be a kv_spec.KVCacheLayout, got {type(layout).__name__}; pass the "
            "cache's layout (e.g. plan_kv_cache(...) or KVCacheLayout.from_dict(d))"
        )


def _check_layout_matches(config: AttentionConfig, layout: KVCacheLayout) -> None:
    mism = []
    if layout.num_kv_heads != config.num_kv_heads:
        mism.append(f"num_kv_heads {layout.num_kv_heads} vs {config.num_kv_heads}")
    if layout.head_size != config.head_size:
        mism.append(f"head_size {layout.head_size} vs {config.head_size}")
    if not layout.is_mla and layout.head_size_v != config.head_size_v:
        mism.append(f"head_size_v {layout.head_size_v} vs {config.head_size_v}")
    if layout.dtype != config.kv_cache_dtype:
        mism.append(f"dtype {layout.dtype} vs kv_cache_dtype {config.kv_cache_dtype}")
    if layout.order.value != config.layout_order:
        mism.append(f"order {layout.order.value} vs {config.layout_order}")
    if layout.block_size != config.block_size:
        mism.append(f"block_size {layout.block_size} vs {config.block_size}")
    if mism:
        raise ValueError(
            "the KV-cache layout does not match the attention config: " + "; ".join(mism)
        )


def kernel_block_view(
    kv_cache: torch.Tensor, layout: KVCacheLayout, kernel_block_size: int
) -> tuple[torch.Tensor, KVCacheLayout]:
    """View manager blocks of ``layout.block_size`` tokens as kernel blocks of ``kernel_block_size``.

    Manager block ``b`` becomes kernel blocks ``b*k + i`` (``k = block_size // kernel_block_size``).
    That is one plain view when kv-spec's rule allows it (LBNHC or LHBNC, pages neither padded nor
    carrying a scale plane, :meth:`kv_spec.KVCacheLayout.kernel_block_problem`); other caches
    raise, since a copy would defeat the point. This is :func:`kv_kernels.kernel_block_view`.
    """
    from kv_kernels.cache import kernel_block_view as _kernels_view

    return _kernels_view(kv_cache, layout, kernel_block_size)


def _strided_kernel_view(
    kv_cache: torch.Tensor, block_size: int, kernel_block_size: int
) -> torch.Tensor:
    """The per-step view of a cache whose layout :func:`kernel_block_view` already accepted
    (no layout rebuilt each step): only the tensor's own block stride is checked again."""
    sb, sh, sn, sc = kv_cache.stride()
    if sb != block_size * sn:
        raise ValueError(
            f"kv_cache block stride {sb} != block_size x token stride {block_size * sn}: "
            "not the layer view of this layout; pass kv_kernels.layer_view(storage, layout, layer)"
        )
    b, h, _, c = kv_cache.shape
    k = block_size // kernel_block_size
    return kv_cache.as_strided(
        (b * k, h, kernel_block_size, c), (kernel_block_size * sn, sh, sn, sc)
    )
