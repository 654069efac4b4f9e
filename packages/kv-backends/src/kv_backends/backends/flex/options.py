"""FLEX_ATTENTION's tiles: :class:`FlexOptions` (query / KV block-mask tiles and the kernel's
``BLOCK_M`` / ``BLOCK_N``), validated against the kernel block size, the builder's resolution of
its tile options, and what this torch's Flex takes (``BACKEND``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kv_backends.config import AttentionConfig

__all__ = [
    "FlexOptions",
    "flex_has_backend_option",
    "pow2_at_least",
    "resolve_builder_options",
    "valid_kv_block_sizes",
]


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _pow2_divisors(x: int, lo: int = 16) -> list[int]:
    """Powers of 2 >= ``lo`` dividing ``x`` (the valid tiles inside ``x``)."""
    return [1 << i for i in range(lo.bit_length() - 1, x.bit_length()) if x % (1 << i) == 0]


def _pow2_near(v: int) -> list[int]:
    """The powers of 2 >= 16 next to ``v`` (below and above), for error messages."""
    below = 1 << max(4, v.bit_length() - 1) if v > 0 else 16
    return sorted({below, max(16, below * 2 if below < v else below)})


def valid_kv_block_sizes(n: int, *, batch_invariant: bool, limit: int = 1024) -> list[int]:
    """The ``kv_block_size`` values :meth:`FlexOptions.resolve` accepts for kernel block ``n``
    (up to ``limit``): powers of 2 >= 16 dividing ``n``, plus, without batch invariance, the
    multiples of ``n`` (when ``n`` is a power of 2)."""
    out = _pow2_divisors(n)
    if not batch_invariant and _is_pow2(n):
        out += [v for v in (1 << i for i in range(4, limit.bit_length())) if v > n]
    return out


@dataclass(frozen=True)
class FlexOptions:
    """Tile sizes of the Flex backend, validated against the kernel block size ``n``.

    - ``q_block_size``: query tokens per block-mask row (power of 2, >= 16; default 128).
    - ``kv_block_size``: physical KV tokens per block-mask column (power of 2, >= 16, dividing
      ``n`` or a multiple of it; ``<= n`` under batch invariance so a tile never mixes requests).
    - ``block_m`` / ``block_n``: the kernel's tiles (``kernel_options`` ``BLOCK_M`` /
      ``BLOCK_N``), powers of 2 >= 16 dividing ``q_block_size`` / ``kv_block_size``.

    One value is the per-layer Flex configuration: the builder lays the block mask out with it,
    the impl passes its kernel options, and :func:`~kv_backends.backends.flex.trainer.flex_trainer_attention`
    (the trainer's dense call) takes the same value, which is what makes their numerics equal.
    """

    q_block_size: int
    kv_block_size: int
    block_m: int
    block_n: int

    @classmethod
    def resolve(
        cls,
        n: int,
        *,
        batch_invariant: bool = False,
        q_block_size: int | None = None,
        kv_block_size: int | None = None,
        block_m: int | None = None,
        block_n: int | None = None,
    ) -> FlexOptions:
        """Defaults filled in, every value validated; errors name the value, the bound and the
        values that would be valid."""
        if kv_block_size is None:
            # Largest power of 2 dividing n, capped at 128; without batch invariance at least 64
            # (big tiles are what makes Flex fast), which is then a multiple of a small n.
            pow2 = n & -n
            kv_block_size = min(pow2, 128)
            if not batch_invariant and kv_block_size < 64 and _is_pow2(n):
                kv_block_size = 64
        # 128-query blocks (16-row blocks ran prefill at ~5% of dense) with BLOCK_M = 64,
        # BLOCK_N = 64: on an H100 (torch 2.11, bf16 head 128) 64-row tiles over 4 warps ran the
        # paged prefill 6-10% faster than torch's own 128 x 64 over 8 warps, within 2-3% of
        # dense causal Flex (the impl pins the warps, FlexAttentionImpl._kernel_options).
        # Decodes never see this size (they have their own call).
        q_block_size = 128 if q_block_size is None else q_block_size
        block_m = min(q_block_size, 64) if block_m is None else block_m
        block_n = min(kv_block_size, 64) if block_n is None else block_n
        for name, v in (
            ("q_block_size", q_block_size),
            ("kv_block_size", kv_block_size),
            ("block_m", block_m),
            ("block_n", block_n),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"flex {name}={v!r} must be an int (a power of 2 >= 16)")
            if not _is_pow2(v) or v < 16:
                raise ValueError(
                    f"flex {name}={v} must be a power of 2 >= 16; nearest valid: {_pow2_near(v)}"
                )
        valid_kv = valid_kv_block_sizes(n, batch_invariant=batch_invariant)
        if n % kv_block_size and kv_block_size % n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must divide the kernel block size {n} or be a "
                f"multiple of it; valid: {valid_kv or 'none (the kernel block size has no power-of-2 divisor >= 16)'}"
            )
        if batch_invariant and kv_block_size > n:
            raise ValueError(
                f"flex kv_block_size={kv_block_size} must be <= the kernel block size {n} under "
                f"batch invariance (a KV tile must not mix blocks of different requests); valid: {valid_kv}"
            )
        if q_block_size % block_m:
            raise ValueError(
                f"flex block_m={block_m} must divide q_block_size={q_block_size}; "
                f"valid: {_pow2_divisors(q_block_size)}"
            )
        if kv_block_size % block_n:
            raise ValueError(
                f"flex block_n={block_n} must divide kv_block_size={kv_block_size}; "
                f"valid: {_pow2_divisors(kv_block_size)}"
            )
        return cls(q_block_size, kv_block_size, block_m, block_n)

    def kernel_options(
        self, *, main_template: bool, batch_invariant: bool = False, block_n: int | None = None
    ) -> dict[str, Any]:
        """``kernel_options`` for a CUDA Flex call with these tiles.

        ``main_template=True`` pins Flex's main kernel with ``BLOCK_M`` / ``BLOCK_N``: the
        batch-invariant calls and the trainer's dense call use exactly this dict, because the
        decoding kernel's split count follows the batch size. ``False`` (a decode call outside
        batch invariance) asks for the split-KV decoding kernel by name where this torch has the
        ``BACKEND`` option (it raises rather than silently falling back when the call cannot use
        it), pinning only ``BLOCK_N``; its ``BLOCK_M`` covers the packed GQA rows and torch
        sizes it.

        ``batch_invariant=True`` also pins ``IS_DIVISIBLE=False``: torch otherwise picks it per
        call from the sequence lengths (padded paged call vs the trainer's exact lengths), and
        the two kernel variants differ in more than their boundary loads (masking between ops
        can change which multiply-adds the compiler fuses). Pinned, both calls run one variant.

        ``block_n`` overrides ``BLOCK_N`` (the decode call's tiles may be one page, narrower than
        ``kv_block_size``; under batch invariance they are not, and it equals ``self.block_n``)."""
        block_n = self.block_n if block_n is None else block_n
        if main_template:
            # The legacy switch, not BACKEND="TRITON": older torch (2.11) has no BACKEND option.
            opts: dict[str, Any] = {
                "BLOCK_M": self.block_m,
                "BLOCK_N": block_n,
                "FORCE_USE_FLEX_ATTENTION": True,
            }
            if batch_invariant:
                opts["IS_DIVISIBLE"] = False
            return opts
        dec: dict[str, Any] = {"BLOCK_N": block_n}
        if flex_has_backend_option():
            dec["BACKEND"] = "TRITON_DECODE"
        return dec


@functools.cache
def flex_has_backend_option() -> bool:
    """Whether this torch's Flex takes ``kernel_options["BACKEND"]`` (torch >= 2.12 or so)."""
    from torch.nn.attention import flex_attention as fa

    return hasattr(fa, "_Backend")


def pow2_at_least(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def resolve_builder_options(
    config: AttentionConfig,
    options: FlexOptions | None,
    q_block_size: int | None,
    kv_block_size: int | None,
    block_m: int | None,
    block_n: int | None,
) -> FlexOptions:
    """The builder's tiles: one :class:`FlexOptions` value, or the four loose options (not
    both); validated against the kernel block size either way."""
    assert config.kernel_block_size is not None
    loose = {
        "q_block_size": q_block_size,
        "kv_block_size": kv_block_size,
        "block_m": block_m,
        "block_n": block_n,
    }
    if options is not None:
        given = sorted(k for k, v in loose.items() if v is not None)
        if given:
            raise ValueError(
                f"pass the Flex tiles either as options=FlexOptions(...) or as {given}, not both"
            )
        if not isinstance(options, FlexOptions):
            raise TypeError(f"options={options!r} must be a FlexOptions (FlexOptions.resolve(...))")
        loose = {
            "q_block_size": options.q_block_size,
            "kv_block_size": options.kv_block_size,
            "block_m": options.block_m,
            "block_n": options.block_n,
        }
    return FlexOptions.resolve(
        config.kernel_block_size, batch_invariant=config.batch_invariant, **loose
    )
