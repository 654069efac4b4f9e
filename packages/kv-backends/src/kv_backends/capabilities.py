"""What a backend can serve, as one literal per backend class.

Every backend class declares ``CAPABILITIES = BackendCapabilities(...)`` with literals only (strings,
ints, bools, ``None`` and tuples of those), so ``tools/generate_backend_docs.py`` reads it with
``ast`` without importing torch, and :meth:`kv_backends.AttentionBackend.validate` reads the very
same object at run time. A subclass that declares none inherits its parent's.

Encodings chosen to stay literal-friendly:

- head sizes: ``head_sizes`` lists the exact values a kernel was built for; when it is ``None``,
  ``head_size_rule = (min, max, multiple_of)`` bounds them. Both apply to K's and V's head size.
- kernel block sizes: ``kernel_block_sizes`` lists exact values, ``kernel_block_size_multiple_of``
  asks for multiples; either may be ``None`` (no constraint of that kind).
- compute capability: ``(major, minor)`` tuples, inclusive bounds, ``None`` = unbounded.
- CUDA-graph support: one of :data:`CUDAGRAPH_LEVELS` (weakest first).
- version rules: a backend that wraps several versions of one library (FlashAttention 2/3/4)
  declares how it picks one in ``version_rules``, a literal dict (see
  :data:`VERSION_RULE_KEYS`), so the docs tool renders them without knowing the backend.

The vocabularies (layout orders, quantization modes, dtype names) are kv-spec's: they are spelled
out here as literals for the docs tool, and checked against ``kv_spec.LayoutOrder``,
``kv_spec.KVQuantMode`` and ``kv_spec.DTYPE_BYTES`` at import time, so they cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Final

from kv_spec import DTYPE_BYTES, KVQuantMode, LayoutOrder

__all__ = [
    "CUDAGRAPH_ALWAYS",
    "CUDAGRAPH_LEVELS",
    "CUDAGRAPH_NEVER",
    "CUDAGRAPH_UNIFORM_BATCH",
    "CUDAGRAPH_UNIFORM_SINGLE_TOKEN_DECODE",
    "VERSION_RULE_KEYS",
    "BackendCapabilities",
]

#: The backend's metadata builder syncs with the host or allocates: no CUDA-graph capture.
CUDAGRAPH_NEVER: Final = "never"
#: Graphs can be captured for pure-decode batches of one query token per request.
CUDAGRAPH_UNIFORM_SINGLE_TOKEN_DECODE: Final = "uniform_single_token_decode"
#: Graphs can be captured for batches where every request has the same query length.
CUDAGRAPH_UNIFORM_BATCH: Final = "uniform_batch"
#: Any batch (mixed prefill and decode) can be captured.
CUDAGRAPH_ALWAYS: Final = "always"
#: Every level, weakest first.
CUDAGRAPH_LEVELS: Final[tuple[str, ...]] = (
    CUDAGRAPH_NEVER,
    CUDAGRAPH_UNIFORM_SINGLE_TOKEN_DECODE,
    CUDAGRAPH_UNIFORM_BATCH,
    CUDAGRAPH_ALWAYS,
)

_LAYOUT_ORDERS: Final = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")
_KV_QUANT_MODES: Final = ("none", "fp8_per_tensor", "int8_per_token_head", "fp8_per_token_head")

# The literals above exist for the docs tool (it reads this file with ast); kv-spec owns the
# vocabulary. Fail at import, naming both, if they ever disagree.
if tuple(o.value for o in LayoutOrder) != _LAYOUT_ORDERS:
    raise ImportError(
        f"kv_backends.capabilities._LAYOUT_ORDERS={_LAYOUT_ORDERS} != kv_spec.LayoutOrder "
        f"{tuple(o.value for o in LayoutOrder)}; update the literal"
    )
if tuple(m.value for m in KVQuantMode) != _KV_QUANT_MODES:
    raise ImportError(
        f"kv_backends.capabilities._KV_QUANT_MODES={_KV_QUANT_MODES} != kv_spec.KVQuantMode "
        f"{tuple(m.value for m in KVQuantMode)}; update the literal"
    )

#: Keys of ``BackendCapabilities.version_rules`` (all required):
#:
#: - ``title``: the docs section title; ``label``: how a version is named (``"FA{}"`` -> ``FA3``);
#: - ``config_field``: the :class:`~kv_backends.AttentionConfig` field that forces a version;
#: - ``versions``: version -> dict of what it supports (``module`` and ``package`` it comes from,
#:   ``min_compute_capability`` / ``max_compute_capability``, and feature keys);
#: - ``preferred``: ``((min cc major, version), ...)``, the first row the device meets wins;
#: - ``upgrades``: ``({"on_major", "from_version", "to_version", "when"}, ...)``, named conditions
#:   that move a preference;
#: - ``conditions``: condition name -> what it means, in words;
#: - ``fallback_order``: the order other versions are tried in.
VERSION_RULE_KEYS: Final = (
    "title",
    "label",
    "config_field",
    "versions",
    "preferred",
    "upgrades",
    "conditions",
    "fallback_order",
)


def _check_version_rules(rules: dict[str, Any]) -> None:
    missing = [k for k in VERSION_RULE_KEYS if k not in rules]
    unknown = [k for k in rules if k not in VERSION_RULE_KEYS]
    if missing or unknown:
        raise ValueError(
            f"version_rules: missing keys {missing}, unknown keys {unknown}; use {VERSION_RULE_KEYS}"
        )
    versions = rules["versions"]
    named = [v for _, v in rules["preferred"]] + list(rules["fallback_order"])
    for rule in rules["upgrades"]:
        named += [rule["from_version"], rule["to_version"]]
        if rule["when"] not in rules["conditions"]:
            raise ValueError(
                f"version_rules upgrade names condition {rule['when']!r} that 'conditions' does "
                "not explain"
            )
    bad = sorted({v for v in named if v not in versions})
    if bad:
        raise ValueError(f"version_rules name versions {bad} that 'versions' does not declare")


@dataclass(frozen=True, kw_only=True)
class BackendCapabilities:
    """What one backend serves. Declare it as one literal; see the module docstring for encodings.

    Fields (all required unless they have a default):

    - ``dtypes``: compute dtypes of queries and outputs (kv-spec names, e.g. ``"bfloat16"``).
    - ``kv_cache_dtypes``: element dtypes the cache may hold.
    - ``kv_quant_modes``: :class:`kv_spec.KVQuantMode` values it reads.
    - ``head_sizes`` / ``head_size_rule``: see the module docstring.
    - ``supports_head_size_v_diff``: serves ``head_size_v != head_size`` (DiffKV) layers;
      ``requires_head_size_v_diff``: serves only those.
    - ``kernel_block_sizes`` / ``kernel_block_size_multiple_of``: kernel (page) block sizes.
    - ``supported_layouts``: layout orders (``kv_spec.LayoutOrder`` names) it reads;
      ``required_layout``: the one it needs the resolver to pick, if any.
    - ``sinks``, ``sliding_window``, ``softcap``, ``alibi``, ``mla``, ``non_causal``,
      ``batch_invariant``: feature support.
    - ``cudagraph_support``: one of :data:`CUDAGRAPH_LEVELS`.
    - ``min_compute_capability`` / ``max_compute_capability``: inclusive ``(major, minor)`` bounds
      on CUDA devices.
    - ``needs_gpu``: cannot run on the CPU at all.
    - ``notes``: one sentence for the docs table.
    - ``version_rules``: how a multi-version backend picks a version (see the module docstring).
    """

    dtypes: tuple[str, ...]
    kv_cache_dtypes: tuple[str, ...]
    kv_quant_modes: tuple[str, ...] = ("none",)
    head_sizes: tuple[int, ...] | None = None
    head_size_rule: tuple[int, int, int] | None = None
    supports_head_size_v_diff: bool = False
    requires_head_size_v_diff: bool = False
    kernel_block_sizes: tuple[int, ...] | None = None
    kernel_block_size_multiple_of: int | None = None
    supported_layouts: tuple[str, ...] = _LAYOUT_ORDERS
    required_layout: str | None = None
    sinks: bool = False
    sliding_window: bool = False
    softcap: bool = False
    alibi: bool = False
    mla: bool = False
    non_causal: bool = False
    batch_invariant: bool = False
    cudagraph_support: str = CUDAGRAPH_NEVER
    min_compute_capability: tuple[int, int] | None = None
    max_compute_capability: tuple[int, int] | None = None
    needs_gpu: bool = False
    notes: str = ""
    version_rules: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Catch typos in a declaration at import time, not when a user first selects the backend.
        if self.head_sizes is None and self.head_size_rule is None:
            raise ValueError("BackendCapabilities needs head_sizes or head_size_rule; got neither")
        if self.head_size_rule is not None:
            lo, hi, mult = self.head_size_rule
            if not (0 < lo <= hi and mult > 0):
                raise ValueError(
                    f"head_size_rule={self.head_size_rule} must be (min, max, multiple_of) with "
                    "0 < min <= max and multiple_of > 0"
                )
        bad = [o for o in self.supported_layouts if o not in _LAYOUT_ORDERS]
        if bad or not self.supported_layouts:
            raise ValueError(
                f"supported_layouts={self.supported_layouts} must be a non-empty tuple of {_LAYOUT_ORDERS}"
            )
        if self.required_layout is not None and self.required_layout not in self.supported_layouts:
            raise ValueError(
                f"required_layout={self.required_layout!r} is not in supported_layouts={self.supported_layouts}"
            )
        for name in ("dtypes", "kv_cache_dtypes"):
            unknown = [d for d in getattr(self, name) if d not in DTYPE_BYTES]
            if unknown:
                raise ValueError(
                    f"{name} has {unknown}, which are not kv-spec dtype names {list(DTYPE_BYTES)}"
                )
        if self.version_rules is not None:
            _check_version_rules(self.version_rules)
        bad = [m for m in self.kv_quant_modes if m not in _KV_QUANT_MODES]
        if bad:
            raise ValueError(f"kv_quant_modes has unknown modes {bad}; use {_KV_QUANT_MODES}")
        if self.cudagraph_support not in CUDAGRAPH_LEVELS:
            raise ValueError(
                f"cudagraph_support={self.cudagraph_support!r} is not one of {CUDAGRAPH_LEVELS}"
            )
        if self.requires_head_size_v_diff and not self.supports_head_size_v_diff:
            raise ValueError("requires_head_size_v_diff=True needs supports_head_size_v_diff=True")
        if (
            self.kernel_block_size_multiple_of is not None
            and self.kernel_block_size_multiple_of <= 0
        ):
            raise ValueError(
                f"kernel_block_size_multiple_of={self.kernel_block_size_multiple_of} must be positive"
            )

    # -- rules -------------------------------------------------------------------------------

    def head_size_ok(self, head_size: int) -> bool:
        if self.head_sizes is not None:
            return head_size in self.head_sizes
        assert self.head_size_rule is not None
        lo, hi, mult = self.head_size_rule
        return lo <= head_size <= hi and head_size % mult == 0

    def describe_head_sizes(self) -> str:
        if self.head_sizes is not None:
            return f"one of {list(self.head_sizes)}"
        assert self.head_size_rule is not None
        lo, hi, mult = self.head_size_rule
        return f"in [{lo}, {hi}] and a multiple of {mult}"

    def kernel_block_size_ok(self, size: int) -> bool:
        if self.kernel_block_sizes is not None and size not in self.kernel_block_sizes:
            return False
        mult = self.kernel_block_size_multiple_of
        return mult is None or size % mult == 0

    def describe_kernel_block_sizes(self) -> str:
        parts = []
        if self.kernel_block_sizes is not None:
            parts.append(f"one of {list(self.kernel_block_sizes)}")
        if self.kernel_block_size_multiple_of is not None:
            parts.append(f"a multiple of {self.kernel_block_size_multiple_of}")
        return " and ".join(parts) if parts else "any size"

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
