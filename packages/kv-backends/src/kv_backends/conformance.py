"""Conformance cases: every capability a backend's ``CAPABILITIES`` literal declares, as test
cases against kv-kernels' float64 oracle (docs/attention_semantics.md).

Axes, all read from the literal (nothing per backend is written here):

- feature: ``plain`` (GQA, causal) and one case per declared feature flag: ``sliding_window``,
  ``sinks``, ``softcap``, ``alibi``, ``non_causal`` (and ``non_causal_window`` when both are
  declared), ``head_size_v_diff``; a backend that requires ``head_size_v != head_size`` gets it
  in every case. Declared flags this suite cannot exercise make :func:`untestable_claims`
  non-empty, which fails a test: a claim nobody tests is not declared. ``mla`` has its own cases
  (:func:`mla_cases_for`): a latent cache (:func:`kv_backends.testing.make_latent_batch`,
  ``MLA_LATENT`` wide) attended absorbed, over the same dtype, KV-cache dtype (fp8 latents
  with one ``k_scale`` where ``fp8_per_tensor`` is declared), order and block axes.
- compute dtype: ``dtypes`` (on the CPU: float32 and float16 only; the Triton interpreter computes
  bf16 wrongly, see DESIGN.md).
- KV-cache dtype: each float ``kv_cache_dtypes`` entry with the equal compute dtype (quant
  ``none``), each fp8 entry with every compute dtype (quant ``fp8_per_tensor``, when declared).
- layout order: ``supported_layouts``.
- (manager block, kernel block): ``(16, 16)``, ``(32, 32)``, ``(64, 64)`` and the split
  ``(64, 16)`` (on the GPU also ``(128, 128)``, ``(256, 256)``), kept when the literal's kernel
  block rule takes the kernel size and ``validate`` accepts the combination (a split needs a
  splittable order).

Sampling (the full product is thousands of cases). ``KVSTACK_CONFORMANCE=full`` runs it all.
Otherwise, per backend: shuffle the product with ``random.Random(f"{seed}:{backend}")`` (seed
``KVSTACK_CONFORMANCE_SEED``, default 0) and keep, in that order, each case that covers a pair not
yet covered among (feature, v) for v in every other axis and (dtype, cache dtype): every feature
meets every dtype, cache dtype, order and block pair at least once.

The tests live in ``packages/kv-backends/tests/test_conformance.py``; a third-party backend can
reuse these cases the same way (it is registered by name in ``kv_backends.registry``).
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from typing import Any

from kv_backends import AttentionConfig, get_backend
from kv_backends.capabilities import BackendCapabilities

__all__ = [
    "FEATURES",
    "MLA_LATENT",
    "Case",
    "cases_for",
    "feature_kwargs",
    "full_product",
    "mla_cases_for",
    "mla_product",
    "serves_kv_layers",
    "untestable_claims",
]

#: Feature -> the capability flag(s) it needs and the make_paged_batch kwargs that exercise it.
FEATURES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "plain": ((), {}),
    "sliding_window": (("sliding_window",), {"sliding_window": 7}),
    "sinks": (("sinks",), {"has_sinks": True}),
    "softcap": (("softcap",), {"softcap": 3.0}),
    "alibi": (("alibi",), {"use_alibi": True}),
    "non_causal": (("non_causal",), {"causal": False}),
    "non_causal_window": (("non_causal", "sliding_window"), {"causal": False, "sliding_window": 6}),
    "head_size_v_diff": (("supports_head_size_v_diff",), {"head_size_v_diff": True}),
}

#: Flags this suite knows how to test (a feature above, or a dedicated test: batch invariance and
#: CUDA graphs have their own tests). Anything else declared True is an untestable claim.
_TESTED_FLAGS = {
    "sliding_window",
    "sinks",
    "softcap",
    "alibi",
    "non_causal",
    "supports_head_size_v_diff",
    "requires_head_size_v_diff",
    "batch_invariant",
    "needs_gpu",
    # MLA has its own cases (mla_cases_for: a latent cache attended absorbed, every dtype, order
    # and block pair); the feature cases above are for K/V layers, which an MLA-only backend
    # rejects.
    "mla",
}
_FLAG_FIELDS = (
    "sinks",
    "sliding_window",
    "softcap",
    "alibi",
    "mla",
    "non_causal",
    "batch_invariant",
    "supports_head_size_v_diff",
    "requires_head_size_v_diff",
)

_CPU_DTYPES = ("float32", "float16")
#: ``(kv_lora_rank, rope)`` of the MLA cases' latent row: a power-of-two latent plus a 16-wide
#: rope tail, the smallest row TRITON_MLA's kernel split takes (48; DeepSeek-V3 512 + 64).
MLA_LATENT = (32, 16)
_BLOCKS_CPU = ((16, 16), (32, 32), (64, 64), (64, 16))
_BLOCKS_GPU = (*_BLOCKS_CPU, (128, 128), (256, 256))


@dataclass(frozen=True)
class Case:
    backend: str
    feature: str
    dtype: str
    cache_dtype: str
    order: str
    block_size: int
    kernel_block_size: int

    @property
    def id(self) -> str:
        cache = "" if self.cache_dtype == self.dtype else f"-kv_{self.cache_dtype}"
        return (
            f"{self.backend}-{self.feature}-{self.dtype}{cache}-{self.order}-"
            f"b{self.block_size}k{self.kernel_block_size}"
        )


def untestable_claims(caps: BackendCapabilities) -> list[str]:
    """Feature flags the literal declares that no test here exercises."""
    return [f for f in _FLAG_FIELDS if getattr(caps, f) and f not in _TESTED_FLAGS]


def _head_sizes(caps: BackendCapabilities, diff: bool) -> tuple[int, int]:
    """A small (K, V) head size pair the literal allows (V smaller when ``diff``)."""
    ok = [h for h in (32, 64, 16, 48, 128) if caps.head_size_ok(h)]
    if not ok:
        raise AssertionError(f"no small head size satisfies {caps.describe_head_sizes()}")
    if not diff:
        return ok[0], ok[0]
    pairs = [(k, v) for k in ok for v in ok if v < k]
    if not pairs:
        raise AssertionError("head_size_v_diff declared but no two allowed head sizes differ")
    return pairs[0]


def feature_kwargs(case: Case) -> dict[str, Any]:
    """``make_paged_batch`` kwargs of a case."""
    caps = get_backend(case.backend).CAPABILITIES
    _, kw = FEATURES[case.feature]
    kw = dict(kw)
    diff = bool(kw.pop("head_size_v_diff", False)) or caps.requires_head_size_v_diff
    hk, hv = _head_sizes(caps, diff)
    return {
        **kw,
        "head_size": hk,
        "head_size_v": hv,
        "dtype": case.dtype,
        "kv_cache_dtype": case.cache_dtype,
        "order": case.order,
        "block_size": case.block_size,
        "kernel_block_size": case.kernel_block_size,
    }


def _caches(caps: BackendCapabilities, dtypes: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for dt in dtypes:
        for cache in caps.kv_cache_dtypes:
            if cache.startswith("fp8"):
                if "fp8_per_tensor" in caps.kv_quant_modes:
                    out.append((dt, cache))
            elif cache == dt:
                out.append((dt, cache))
    return out


def _valid(case: Case) -> bool:
    backend = get_backend(case.backend)
    kw = feature_kwargs(case)
    cfg = AttentionConfig(
        num_q_heads=4,
        num_kv_heads=2,
        head_size=kw["head_size"],
        head_size_v=kw["head_size_v"],
        dtype=case.dtype,
        kv_cache_dtype=case.cache_dtype,
        kv_quant="fp8_per_tensor" if case.cache_dtype.startswith("fp8") else "none",
        block_size=case.block_size,
        kernel_block_size=case.kernel_block_size,
        layout_order=case.order,
        sliding_window=kw.get("sliding_window"),
        has_sinks=kw.get("has_sinks", False),
        softcap=kw.get("softcap", 0.0),
        use_alibi=kw.get("use_alibi", False),
        causal=kw.get("causal", True),
    )
    return not backend.validate(cfg)


def full_product(name: str, *, gpu: bool) -> list[Case]:
    caps = get_backend(name).CAPABILITIES
    feats = [f for f, (flags, _) in FEATURES.items() if all(getattr(caps, x) for x in flags)]
    dtypes = caps.dtypes if gpu else tuple(d for d in caps.dtypes if d in _CPU_DTYPES)
    blocks = tuple(
        b for b in (_BLOCKS_GPU if gpu else _BLOCKS_CPU) if caps.kernel_block_size_ok(b[1])
    )
    cases = [
        Case(name, f, dt, cache, order, bs, kbs)
        for f, (dt, cache), order, (bs, kbs) in itertools.product(
            feats, _caches(caps, dtypes), caps.supported_layouts, blocks
        )
    ]
    return [c for c in cases if _valid(c)]


def _pairs(c: Case) -> set[tuple[str, object, str, object]]:
    axes: dict[str, object] = {
        "dtype": c.dtype,
        "cache": c.cache_dtype,
        "order": c.order,
        "block": (c.block_size, c.kernel_block_size),
    }
    out: set[tuple[str, object, str, object]] = {
        ("feature", c.feature, k, v) for k, v in axes.items()
    }
    out.add(("dtype", c.dtype, "cache", c.cache_dtype))
    return out


def cases_for(name: str, *, gpu: bool = False) -> list[Case]:
    """The cases of backend ``name`` (sampled unless ``KVSTACK_CONFORMANCE=full``)."""
    return _sampled(full_product(name, gpu=gpu), name)


def _sampled(product: list[Case], tag: str) -> list[Case]:
    """``product`` sampled: a seeded shuffle (``KVSTACK_CONFORMANCE_SEED``, ``tag``), keeping a
    case while it covers a pair of options no kept case covers; all of it with
    ``KVSTACK_CONFORMANCE=full``."""
    if os.environ.get("KVSTACK_CONFORMANCE", "").lower() == "full":
        return product
    seed = os.environ.get("KVSTACK_CONFORMANCE_SEED", "0")
    rng = random.Random(f"{seed}:{tag}")
    shuffled = product[:]
    rng.shuffle(shuffled)
    covered: set[tuple[str, object, str, object]] = set()
    picked = []
    for c in shuffled:
        new = _pairs(c) - covered
        if new:
            picked.append(c)
            covered |= new
    return picked


def serves_kv_layers(name: str) -> bool:
    """Whether backend ``name`` serves any K/V (non-MLA) case on a GPU (MLA-only backends don't)."""
    return bool(full_product(name, gpu=True))


def _valid_mla(case: Case) -> bool:
    cfg = AttentionConfig(
        num_q_heads=4,
        num_kv_heads=1,
        head_size=sum(MLA_LATENT),
        head_size_v=sum(MLA_LATENT),
        dtype=case.dtype,
        kv_cache_dtype=case.cache_dtype,
        kv_quant="fp8_per_tensor" if case.cache_dtype.startswith("fp8") else "none",
        block_size=case.block_size,
        kernel_block_size=case.kernel_block_size,
        layout_order=case.order,
        mla=True,
    )
    return not get_backend(case.backend).validate(cfg)


def mla_product(name: str, *, gpu: bool) -> list[Case]:
    """Every MLA case of backend ``name`` (none unless its literal declares ``mla``): feature
    ``"mla"``, each declared compute dtype with the equal unquantized latent and, where the
    literal declares ``fp8_per_tensor``, with each fp8 latent dtype (as :func:`full_product`
    pairs them), every order and block pair the literal and ``validate`` take."""
    caps = get_backend(name).CAPABILITIES
    if not caps.mla:
        return []
    dtypes = caps.dtypes if gpu else tuple(d for d in caps.dtypes if d in _CPU_DTYPES)
    blocks = tuple(
        b for b in (_BLOCKS_GPU if gpu else _BLOCKS_CPU) if caps.kernel_block_size_ok(b[1])
    )
    cases = [
        Case(name, "mla", dt, cache, order, bs, kbs)
        for (dt, cache), order, (bs, kbs) in itertools.product(
            _caches(caps, dtypes), caps.supported_layouts, blocks
        )
    ]
    return [c for c in cases if _valid_mla(c)]


def mla_cases_for(name: str, *, gpu: bool = False) -> list[Case]:
    """The MLA cases of backend ``name``, sampled by :func:`cases_for`'s rule (seeded shuffle,
    keep a case while it covers a new (dtype, order) / (dtype, block) / ... pair;
    ``KVSTACK_CONFORMANCE=full`` keeps them all)."""
    return _sampled(mla_product(name, gpu=gpu), f"{name}:mla")
