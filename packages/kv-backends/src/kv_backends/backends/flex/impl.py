"""FLEX_ATTENTION's per-layer impl: the flattened call (one per cache window, merged through
their log-sum-exps), the decode call, sinks folded in from the log-sum-exp, and the output laid
out without a copy where Flex's already is the result. How the backend sees the cache and the
batch: the package docstring (:mod:`kv_backends.backends.flex`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from kv_spec import KVCacheLayout

from kv_backends.backends.flex.compiled import (
    compiled_flex,
    flex_dynamo_limits,
    recompile_limit_hit,
)
from kv_backends.backends.flex.decode import FlexDecode, uses_decoding_kernel
from kv_backends.backends.flex.gather import gather_tokens
from kv_backends.backends.flex.mask_mods import make_score_mod, window_kv_position
from kv_backends.backends.flex.metadata import FlexAttentionMetadata
from kv_backends.backends.flex.options import FlexOptions
from kv_backends.base import AttentionImpl
from kv_backends.config import AttentionConfig

__all__ = ["FlexAttentionImpl"]


def _eager_flex() -> Any:
    """torch's ``flex_attention`` (eager), imported on first use and then read from a module
    global: an import statement costs a module-table lookup on every forward."""
    global _FLEX_ATTENTION
    if _FLEX_ATTENTION is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX_ATTENTION = flex_attention
    return _FLEX_ATTENTION


_FLEX_ATTENTION: Any = None

#: Pipeline stages of Flex's split-KV decoding kernel on CUDA outside batch invariance (measured,
#: see ``FlexAttentionImpl._kernel_options``); ``decode_kernel_options`` overrides it.
_DECODE_NUM_STAGES = 3


class FlexAttentionImpl(AttentionImpl):
    """Per-layer FlexAttention. Option ``compiled``: run ``torch.compile``'d Flex (default: on
    CUDA yes, on CPU no; the eager path is dense math, fine for tests only).
    ``decode_kernel_options``: extra CUDA ``kernel_options`` for the decode call outside batch
    invariance, merged over the backend's (tuning, e.g. ``{"num_stages": 3, "num_warps": 4}``);
    ``kernel_options`` replaces the backend's options for every call instead."""

    def __init__(
        self,
        config: AttentionConfig,
        layout: KVCacheLayout,
        *,
        compiled: bool | None = None,
        kernel_options: dict[str, Any] | None = None,
        decode_kernel_options: dict[str, Any] | None = None,
        options: FlexOptions | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, layout, **kw)
        if compiled is not None and not isinstance(compiled, bool):
            raise TypeError(f"FLEX_ATTENTION compiled={compiled!r} must be a bool or None")
        if options is not None and not isinstance(options, FlexOptions):
            raise TypeError(f"FLEX_ATTENTION options={options!r} must be a FlexOptions")
        if options is not None:
            assert config.kernel_block_size is not None
            # Validate against this layer (a value resolved for another block size may not fit).
            FlexOptions.resolve(
                config.kernel_block_size,
                batch_invariant=config.batch_invariant,
                q_block_size=options.q_block_size,
                kv_block_size=options.kv_block_size,
                block_m=options.block_m,
                block_n=options.block_n,
            )
        self.compiled = compiled
        self.kernel_options = dict(kernel_options) if kernel_options else None
        if decode_kernel_options and config.batch_invariant:
            raise ValueError(
                "FLEX_ATTENTION decode_kernel_options would change the batch-invariant decode "
                "call's kernel (it must match flex_trainer_attention's); drop them"
            )
        self.decode_kernel_options = dict(decode_kernel_options or {})
        #: The layer's tiles when pinned; forward refuses metadata built with other tiles.
        self.options = options
        # Facts forward reads every call, fixed by the layer (host work per layer per step).
        assert layout.v_range is not None
        self._kv_ranges = (*layout.k_range, *layout.v_range)
        self._gqa = self.num_q_heads != layout.num_kv_heads
        self._whole_blocks = config.kernel_block_size == layout.block_size
        self._own_scales = self.k_scale is not None or self.v_scale is not None
        #: What, besides the metadata and q, decides the compiled graphs this layer's calls
        #: run: layers with equal keys share them (``FlexAttentionMetadata.compiled_keys``; an
        #: incomplete key only costs a retry, see compiled.py).
        self.compile_key: tuple[object, ...] = (
            self._q_dtype,
            self._cache_shape,
            self._cache_dtype,
            self.num_q_heads,
            self.head_size_v,
            self.scale,
            self.softcap,
            self.sliding_window,
            config.causal,
            config.batch_invariant,
            self.sinks is not None,
            self.alibi_slopes is not None,
            repr(self.kernel_options),
            repr(self.decode_kernel_options),
            compiled,
        )

    def _kernel_options(
        self, md: FlexAttentionMetadata, device: torch.device, *, decode: bool = False
    ) -> dict[str, Any] | None:
        if self.kernel_options is not None:
            return self.kernel_options
        if device.type != "cuda":
            return None
        # The decode call takes Flex's split-KV decoding kernel unless: batch invariance (its
        # split count follows the batch size; both calls then pass exactly the options
        # flex_trainer_attention passes), unpadded metadata (it needs a static batch), a
        # GQA group that is not a power of 2 (packed into its BLOCK_M rows), or torch without
        # the BACKEND option (2.11) with KV tiles < 128 (not known to work there).
        dec = md.decode if decode else None
        # The decode call's KV tiles may be narrower than the layer's (one page, decode.py).
        kvb = dec.kv_block_size if dec is not None and dec.kv_block_size else None
        kvb = md.options.kv_block_size if kvb is None else kvb
        main = not decode or not uses_decoding_kernel(
            batch_invariant=self.config.batch_invariant,
            static_shapes=md.static_shapes,
            group=self.config.num_queries_per_kv,
            kv_block_size=kvb,
        )
        opts = md.options.kernel_options(
            main_template=main,
            batch_invariant=self.config.batch_invariant,
            block_n=min(md.options.block_n, kvb),
        )
        if main and not decode and not self.config.batch_invariant and self._small_tiles(md):
            # The flattened call (prefill, mixed) outside batch invariance, 16-bit head <= 128:
            # 64 x 64 tiles over 4 warps, 3 stages (FlexOptions' default BLOCK_M is 64). H100,
            # torch 2.11, bf16 32 q / 8 kv heads, causal, ms (torch's default for the same call:
            # 8 warps, 3 stages, BLOCK_M 128): 4 x 4096 page 16 1.456 vs 1.555, page 128 1.473
            # vs 1.566 (dense causal Flex 1.426); 2 x 2048 page 16 0.228 vs 0.253 (dense 0.225).
            # 4 warps at 128 rows ran 1.84 / 3.59, 4 stages at 128 rows 2.11 / 4.09.
            opts.setdefault("num_warps", 4)
            opts.setdefault("num_stages", 3)
        if decode and not self.config.batch_invariant:
            if not main:
                split = dec.split_kv if dec is not None else None
                if kvb < 64 or (split or 1) > 1:
                    # Flex's decoding kernel defaults to 1 stage on sm_90 (no overlap of tile
                    # loads); H200, bf16 32q/8kv, head 128: 3 stages took decode 64 x 4k at page
                    # 16 from 2.22 to 4.07 TB/s, 8 x 32k (split) from 1.14 to 1.70 (page 16) and
                    # 2.22 to 3.45 (page 128), but 64 x 4k at page 128 from 3.93 to 3.70
                    opts["num_stages"] = _DECODE_NUM_STAGES
                if split is not None:
                    opts["SPLIT_KV"] = split
            opts.update(self.decode_kernel_options)
        return opts

    def _small_tiles(self, md: FlexAttentionMetadata) -> bool:
        """Whether the flattened call runs 4 warps, 3 stages (measured, see _kernel_options):
        tiles of at most 64 query rows, 16-bit queries, K/V heads of at most 128 (their shared
        memory fits 3 stages). Otherwise torch's own config for the call."""
        return (
            md.options.block_m <= 64
            and self.config.dtype in ("bfloat16", "float16")
            and max(self.head_size, self.head_size_v) <= 128
        )

    def _flex(
        self,
        fn: Any,
        qx: torch.Tensor,
        cache: torch.Tensor,
        *,
        base_token: int,
        length: int,
        block_mask: Any,
        score_mod: Any,
        need_lse: bool,
        kernel_options: dict[str, Any] | None,
        gather: torch.Tensor | None = None,
        tpb: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One Flex call over the window of ``length`` physical tokens from ``base_token``; K/V
        are ``[1, H, length, D]`` views (batch 1, broadcast over the query batch). With
        ``gather`` (``[length]`` physical tokens) the call reads a gathered copy instead."""
        h = cache.shape[1]
        _, sh, sn, _ = cache.stride()
        base_off = cache.storage_offset() + base_token * sn
        if gather is not None:
            cache = gather_tokens(cache, tpb, gather)  # [G, H, C], token stride H * C
            sh, sn, base_off = cache.stride(1), cache.stride(0), cache.storage_offset()
        k0, k1, v0, v1 = self._kv_ranges
        k = cache.as_strided((1, h, length, k1 - k0), (0, sh, sn, 1), base_off + k0)
        v = cache.as_strided((1, h, length, v1 - v0), (0, sh, sn, 1), base_off + v0)
        kwargs: dict[str, Any] = {
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": self.scale,
            "enable_gqa": self._gqa,
            "kernel_options": kernel_options,
        }
        if not need_lse and fn is not _FLEX_ATTENTION:
            # The hot path (a compiled call, no LSE) warns about nothing: no filters to set up.
            return fn(qx, k, v, **kwargs), None
        with warnings.catch_warnings():
            # return_lse is deprecated in newer torch in favour of return_aux (absent in 2.11).
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            # Eager Flex (compiled=False) is dense math by design here: tests and CPU runs.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            if need_lse:
                kwargs["return_lse"] = True
            res = fn(qx, k, v, **kwargs)
        return res if need_lse else (res, None)

    def forward(
        self,
        layer: object,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexAttentionMetadata,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The host path of every layer's every step (issue 32; bench_flex_host.py measures
        # it): each check reads a tensor attribute once and compares dtypes by identity (torch
        # dtypes are singletons); any failing test runs check_forward_inputs / empty_output,
        # which raise the named errors.
        t, hq, _ = self.forward_q_shape(q, kv_cache, metadata)
        if (
            self.options is not None
            and metadata.options is not self.options
            and metadata.options != self.options
        ):
            raise ValueError(
                f"FLEX_ATTENTION layer tiles {self.options} differ from the metadata's "
                f"{metadata.options}; build the group's metadata with the same FlexOptions"
            )
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return self.empty_output(q, out)
        if out is not None and (
            out.dtype is not self._q_dtype or out.shape != (t, hq, self.head_size_v)
        ):
            self.empty_output(q, out)  # raises the named error
        # [B*k, H, n, C]
        cache = kv_cache if self._whole_blocks else self.kernel_cache(kv_cache)[0]
        # A layer object may carry its own scales; without one the impl's are fixed.
        if self._own_scales if layer is None else any(x is not None for x in self.scales(layer)):
            raise ValueError("FLEX_ATTENTION reads unquantized caches only; got k_scale/v_scale")
        sn = cache.stride(2)
        tpb = metadata.tpb
        if cache.stride(0) != tpb * sn:
            raise ValueError(
                f"kv_cache block stride {cache.stride(0)} does not match the layout the metadata "
                f"was built for ({tpb} tokens x {sn}); pass the layer view of the planned layout"
            )
        use_compiled = self.compiled if self.compiled is not None else q.device.type == "cuda"
        if not use_compiled:
            fn = _eager_flex()
        else:
            # Static graphs on the CPU (see compiled_flex) and wherever the builder pads shapes
            # to captured sizes; otherwise torch's automatic dynamic shapes.
            static = q.device.type != "cuda" or metadata.static_shapes
            fn = compiled_flex(static=static)
        # The log-sum-exp is needed only to apply sinks or merge windows; torch's compiled CPU
        # template cannot return it, so ask for it only then.
        need_lse = self.sinks is not None or len(metadata.windows) > 1
        if need_lse and use_compiled and q.device.type == "cpu":
            raise ValueError(
                "compiled FlexAttention on the CPU cannot return the log-sum-exp, which "
                f"{'sinks need' if self.sinks is not None else 'a batch spanning several cache windows needs'}; "
                "use compiled=False on the CPU"
            )
        if not use_compiled:
            return self._calls(fn, q, cache, metadata, out, need_lse)
        # Dynamo's limits are raised for our compiled calls only, and only where they may
        # compile: the first forward of this kind of layer over this metadata (compiled.py).
        if self.compile_key not in metadata.compiled_keys:
            with flex_dynamo_limits():
                result = self._calls(fn, q, cache, metadata, out, need_lse)
            metadata.compiled_keys.add(self.compile_key)
            return result
        try:
            return self._calls(fn, q, cache, metadata, out, need_lse)
        except recompile_limit_hit():
            # A graph the layer's kind did not need before (a q of other strides, say), past
            # the process's own limit: raised before anything ran, so the calls run again.
            with flex_dynamo_limits():
                return self._calls(fn, q, cache, metadata, out, need_lse)

    def _calls(
        self,
        fn: Any,
        q: torch.Tensor,
        cache: torch.Tensor,
        metadata: FlexAttentionMetadata,
        out: torch.Tensor | None,
        need_lse: bool,
    ) -> torch.Tensor:
        """The flattened call then the decode call; forward's output."""
        result = out
        if metadata.windows:
            result = self._forward_flat(fn, q, cache, metadata, out, need_lse)
        if metadata.decode is not None:
            # After the flattened call: it leaves the decode requests' rows empty (or NaN).
            result = self._forward_decode(fn, q, cache, metadata, metadata.decode, result)
        return self.empty_output(q, None) if result is None else result

    def _new_output(self, q: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A new ``[T, Hq, Dv]`` output whose rows from ``num_tokens`` on are zero (the caller
        writes the rows before)."""
        res = self.empty_output(q, None, zeroed=False)
        if res.shape[0] > num_tokens:
            res[num_tokens:].zero_()
        return res

    @staticmethod
    def _own_output(q: torch.Tensor, o: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
        """``o`` (``[rows, Hq, Dv]``, a Flex call's output, real rows first) as forward's result
        without a copy: its first ``q.shape[0]`` rows, rows from ``num_tokens`` on zeroed.
        ``None`` where that is not the contract's contiguous ``[T, Hq, Dv]`` in q's dtype (fewer
        rows than q, a layout Flex did not make row-major) or where writing into it in place
        would break autograd."""
        t = q.shape[0]
        if o.shape[0] < t or o.dtype != q.dtype or o.requires_grad:
            return None
        res = o[:t]
        if not res.is_contiguous():
            return None
        if t > num_tokens:
            res[num_tokens:].zero_()
        return res

    def _forward_flat(
        self,
        fn: Any,
        q: torch.Tensor,
        cache: torch.Tensor,
        md: FlexAttentionMetadata,
        out: torch.Tensor | None,
        need_lse: bool,
    ) -> torch.Tensor:
        """The flattened call; returns forward's output with its rows written (``out`` when
        given, else Flex's own output where it can be, see :meth:`_own_output`)."""
        num_tokens, padded = md.num_actual_tokens, md.padded_tokens
        if q.shape[0] >= padded:
            qx = q[:padded].transpose(0, 1)[None]  # [1, Hq, T_padded, D], a view
        else:
            # The caller's q is shorter than the captured size: one copy, the padding rows
            # zeroed (they see no key; zeros keep them finite), not the whole buffer.
            qpad = q.new_empty(padded, *q.shape[1:])
            # (narrow / copy_: the same two kernels as slice assignment, less Python around them)
            qpad.narrow(0, 0, num_tokens).copy_(q.narrow(0, 0, num_tokens))
            qpad.narrow(0, num_tokens, padded - num_tokens).zero_()
            qx = qpad.transpose(0, 1)[None]
        kernel_options = self._kernel_options(md, q.device)
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        for win in md.windows:
            o, lse = self._flex(
                fn,
                qx,
                cache,
                base_token=win.base_token,
                length=win.length,
                block_mask=win.block_mask,
                score_mod=self._score_mod(md, win.base_token // md.tpb),
                need_lse=need_lse,
                kernel_options=kernel_options,
                gather=win.gather,
                tpb=md.tpb,
            )
            # Flex lays its output out in the query's stride order (torch's lowering and eager
            # path both do), so with qx a transposed [T, Hq, D] this is a contiguous
            # [T_padded, Hq, Dv]: forward can return it as is, no copy.
            outs.append(o[0].transpose(0, 1))  # [T_padded, Hq, Dv]
            if lse is not None:
                lses.append(lse[0, :, :num_tokens].float())  # [Hq, T]
        if not need_lse:
            # The common case: one window, no sinks.
            if out is None:
                own = self._own_output(q, outs[0], num_tokens)
                if own is not None:
                    return own
            result = self._new_output(q, num_tokens) if out is None else out
            result[:num_tokens] = outs[0][:num_tokens]
            return result
        # Sinks or several windows: the output is computed anew, written once into the result.
        result = self._new_output(q, num_tokens) if out is None else out
        dest = result[:num_tokens]  # [T, Hq, Dv]
        if len(outs) == 1:
            assert self.sinks is not None
            sinks = self.device_params(q.device).sinks
            assert sinks is not None
            gate = torch.sigmoid(lses[0].transpose(0, 1) - sinks[None])  # [T, Hq] float32
            # float32 math, rounded once into the result (as out.float() * gate then .to()).
            torch.mul(outs[0][:num_tokens], gate[..., None], out=dest)
            return result
        lse_all = torch.stack(lses)  # [W, Hq, T]
        lse = torch.logsumexp(lse_all, dim=0)
        weights = torch.exp(lse_all - lse[None]).nan_to_num(0.0)  # [W, Hq, T]
        stacked = torch.stack([x[:num_tokens].transpose(0, 1) for x in outs]).float()
        o = (stacked * weights[..., None]).sum(0)  # [Hq, T, Dv] float32
        if self.sinks is not None:
            sinks = self.device_params(o.device).sinks
            assert sinks is not None
            o = o * torch.sigmoid(lse - sinks[:, None])[..., None]
        dest.copy_(o.transpose(0, 1))  # rounds to the result's dtype
        return result

    def _forward_decode(
        self,
        fn: Any,
        q: torch.Tensor,
        cache: torch.Tensor,
        md: FlexAttentionMetadata,
        dec: FlexDecode,
        result: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decode call, written into its rows of ``result`` (the flattened call's output or
        the caller's ``out``); with ``None`` (a batch of decodes only) forward's output is made
        here, Flex's own where it can be."""
        r, s0 = dec.tok.numel(), dec.start
        # [rows, Hq, 1, D]: a view when the decodes' rows are one run (leading or trailing the
        # batch) and q holds the call's padded rows after it; else gathered.
        view = s0 >= 0 and q.shape[0] >= s0 + dec.rows
        qd = (q[s0 : s0 + dec.rows] if view else q[dec.gather]).unsqueeze(2)
        need_lse = self.sinks is not None
        o, lse = self._flex(
            fn,
            qd,
            cache,
            base_token=dec.base_token,
            length=dec.length,
            block_mask=dec.block_mask,
            score_mod=self._score_mod(md, dec.base_token // md.tpb, dec_pos=dec.pos),
            need_lse=need_lse,
            kernel_options=self._kernel_options(md, q.device, decode=True),
        )
        o = o[:, :, 0]  # [rows, Hq, Dv]
        if lse is not None:
            sinks = self.device_params(o.device).sinks
            assert sinks is not None
            gate = torch.sigmoid(lse[:, :, 0].float() - sinks[None])
            o = (o.float() * gate[..., None]).to(q.dtype)
        if result is None:
            if dec.contiguous and r == md.num_actual_tokens:
                own = self._own_output(q, o, r)
                if own is not None:
                    return own
            result = self._new_output(q, r if dec.contiguous else 0)
        if s0 >= 0:
            result.narrow(0, s0, r).copy_(o.narrow(0, 0, r))
        else:
            result[dec.tok] = o[:r]
        return result

    def _score_mod(
        self, md: FlexAttentionMetadata, base_block: int, *, dec_pos: torch.Tensor | None = None
    ) -> Any:
        """Softcap and ALiBi; a query's position is ``q_pos[q_idx]`` in the flattened call and
        ``dec_pos[b]`` (one query per batch row) in the decode call."""
        softcap, slopes = self.softcap, self.alibi_slopes
        if not softcap and slopes is None:
            return None
        q_pos, ptl = md.q_pos, md.phys_to_logical
        n, tpb, ncols = self.kernel_block_size, md.tpb, md.block_table.shape[1]
        assert n is not None
        slopes_f = None if slopes is None else self.device_params(q_pos.device).alibi_slopes

        def distance(b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            kv_pos = window_kv_position(kv_idx, base_block, tpb, n, ptl, ncols)[3]
            qp = q_pos[q_idx] if dec_pos is None else dec_pos[b]
            return kv_pos - qp

        return make_score_mod(softcap, slopes_f, q_pos.device, distance)
