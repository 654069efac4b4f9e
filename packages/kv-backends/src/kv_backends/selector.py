"""Pick a backend per KV group and say why the others were rejected."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_spec import AttentionSpec, KVCacheGroup

from kv_backends.base import AttentionBackend
from kv_backends.config import AttentionConfig, Platform
from kv_backends.registry import BACKEND_PRIORITY, get_backend

__all__ = [
    "NoBackendError",
    "Rejection",
    "Selection",
    "describe_config",
    "prepare_kernel_block_sizes",
    "select_backend",
]


@dataclass(frozen=True)
class Rejection:
    """A backend the selector passed over, with every reason."""

    name: str
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name}: " + "; ".join(self.reasons)


def describe_config(config: AttentionConfig) -> str:
    """One line: kind, heads, head sizes, dtypes, features, block sizes, layout."""
    heads = f"{config.num_q_heads}q/{config.num_kv_heads}kv heads"
    hs = (
        f"head {config.head_size}"
        if config.head_size == config.head_size_v
        else f"head {config.head_size}/{config.head_size_v}"
    )
    feats = []
    if config.sliding_window is not None:
        feats.append(f"window {config.sliding_window}")
    if config.has_sinks:
        feats.append("sinks")
    if config.softcap:
        feats.append(f"softcap {config.softcap:g}")
    if config.use_alibi:
        feats.append("alibi")
    if config.mla:
        feats.append("MLA")
    if not config.causal:
        feats.append("non-causal")
    if config.batch_invariant:
        feats.append("batch-invariant")
    kv = (
        config.kv_cache_dtype
        if config.kv_quant == "none"
        else f"{config.kv_cache_dtype} {config.kv_quant}"
    )
    block = f"block {config.block_size}"
    if config.kernel_block_size != config.block_size:
        block += f" (kernel {config.kernel_block_size})"
    parts = [
        config.kind,
        heads,
        hs,
        f"{config.dtype} (kv {kv})",
        *feats,
        block,
        config.layout_order,
    ]
    return ", ".join(parts)


@dataclass(frozen=True)
class Selection:
    """The backend chosen for one config on one platform, and every rejected one with reasons.

    ``str(selection)`` renders it for people::

        FLASH_ATTN on sm_90 for full, 64q/8kv heads, head 64, ...
          rejected FLASH_ATTN_DIFFKV: serves only layers with head_size_v != head_size (got 64/64)
          note: FA3 preferred on sm_90 but flash_attn_interface is not installed; using FA4
    """

    backend: type[AttentionBackend]
    config: AttentionConfig
    platform: Platform
    rejected: tuple[Rejection, ...] = ()
    notes: tuple[str, ...] = ()
    explicit: bool = False

    @property
    def name(self) -> str:
        return self.backend.NAME

    def supports_kernel_block_size(self, size: int) -> bool:
        return self.backend.supports_kernel_block_size(size, self.config, self.platform)

    def __str__(self) -> str:
        how = "requested" if self.explicit else "selected"
        lines = [f"{self.name} {how} on {self.platform.label} for {describe_config(self.config)}"]
        lines += [f"  rejected {r}" for r in self.rejected]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class NoBackendError(ValueError):
    """No backend in the platform's priority list can serve the config; ``rejected`` says why."""

    def __init__(self, config: AttentionConfig, platform: Platform, rejected: Sequence[Rejection]):
        self.config = config
        self.platform = platform
        self.rejected = tuple(rejected)
        lines = [f"no attention backend on {platform.label} serves {describe_config(config)}:"]
        lines += [f"  rejected {r}" for r in self.rejected]
        super().__init__("\n".join(lines))


def select_backend(
    config: AttentionConfig,
    platform: Platform | None = None,
    prefer: str | type[AttentionBackend] | None = None,
) -> Selection:
    """Walk ``BACKEND_PRIORITY[platform.name]`` and return the first backend that validates.

    ``platform`` defaults to :meth:`Platform.detect`. ``prefer`` names a backend to use instead of
    the walk; if it cannot serve ``config`` this raises ``ValueError`` with its reasons (never a
    silent fallback). Raises :class:`NoBackendError` when no backend can serve ``config``.
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"select_backend config must be an AttentionConfig; got {type(config).__name__} "
            "(build one with AttentionConfig.from_spec or configs_for_model)"
        )
    if platform is not None and not isinstance(platform, Platform):
        raise TypeError(
            f"select_backend platform must be a Platform or None; got {type(platform).__name__}"
        )
    plat = platform if platform is not None else Platform.detect()
    if prefer is not None:
        backend = _as_backend(prefer)
        reasons = backend.validate(config, plat)
        if reasons:
            raise ValueError(
                f"prefer={backend.NAME} cannot serve {describe_config(config)} on {plat.label}: "
                + "; ".join(reasons)
            )
        return Selection(
            backend, config, plat, notes=tuple(backend.selection_notes(config, plat)), explicit=True
        )
    rejected: list[Rejection] = []
    for name in BACKEND_PRIORITY[plat.name]:
        backend = get_backend(name)
        reasons = backend.validate(config, plat)
        if not reasons:
            return Selection(
                backend, config, plat, tuple(rejected), tuple(backend.selection_notes(config, plat))
            )
        rejected.append(Rejection(name, tuple(reasons)))
    raise NoBackendError(config, plat, rejected)


_Backendish = Selection | type[AttentionBackend] | str


def _as_backend(prefer: object) -> type[AttentionBackend]:
    if isinstance(prefer, str):
        return get_backend(prefer)
    if isinstance(prefer, type) and issubclass(prefer, AttentionBackend):
        return prefer
    raise TypeError(
        f"prefer={prefer!r} must be a backend name (str) or an AttentionBackend subclass; "
        f"known names: {list(BACKEND_PRIORITY['cuda'])}"
    )


def _block_size_of(group: object) -> int:
    if isinstance(group, bool):
        raise ValueError(f"group {group!r} is not a block size")
    if isinstance(group, int):
        return group
    if isinstance(group, KVCacheGroup):
        return group.spec.block_size
    if isinstance(group, (AttentionSpec, AttentionConfig)):
        return group.block_size
    raise ValueError(
        f"group {group!r} must be a manager block size (int), a KVCacheGroup, an AttentionSpec or an AttentionConfig"
    )


def _supports(b: _Backendish, size: int) -> bool:
    if isinstance(b, Selection):
        return b.supports_kernel_block_size(size)
    backend = get_backend(b) if isinstance(b, str) else b
    return backend.supports_kernel_block_size(size)


def _name(b: _Backendish) -> str:
    if isinstance(b, Selection):
        return b.name
    return b.upper() if isinstance(b, str) else b.NAME


def prepare_kernel_block_sizes(
    groups: Sequence[int | KVCacheGroup | AttentionSpec | AttentionConfig],
    backends: Sequence[Sequence[_Backendish]],
) -> list[int]:
    """Per KV group, the largest kernel block size that divides the group's manager block size
    and that every backend of the group supports.

    ``backends[i]`` lists the backends (selections, classes or names) serving group ``i``'s layers.
    Raises ``ValueError`` naming the group, its block size and each backend's rule when none exists.
    """
    if len(groups) != len(backends):
        raise ValueError(
            f"got {len(groups)} groups and {len(backends)} backend lists; pass one list per group"
        )
    out: list[int] = []
    for gi, (group, members) in enumerate(zip(groups, backends, strict=True)):
        block = _block_size_of(group)
        if block <= 0:
            raise ValueError(f"group {gi}: block size {block} must be positive")
        members = list(members)
        divisors = [d for d in range(block, 0, -1) if block % d == 0]
        for d in divisors:
            if all(_supports(b, d) for b in members):
                out.append(d)
                break
        else:
            rules = []
            for b in members:
                ok = [d for d in divisors if _supports(b, d)]
                rules.append(f"{_name(b)} takes {ok if ok else 'none of them'}")
            raise ValueError(
                f"group {gi}: no kernel block size divides the manager block size {block} "
                f"(divisors {divisors}) and suits every backend of the group: {'; '.join(rules)}. "
                "Choose a block size with a common divisor, or other backends for this group"
            )
    return out
