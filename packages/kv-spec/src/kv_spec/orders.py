"""The physical orders of the logical ``[L, B, H, N, C]`` cache, and the one resolver that picks an
order for a deployment (explicit override > backend requirement > connector preference > default,
with the reason). :mod:`kv_spec.layout` builds the layout descriptor on them.
"""

from __future__ import annotations

from enum import Enum
from typing import Final, NamedTuple

from kv_spec import pages

__all__ = ["LOGICAL_DIMS", "LayoutChoice", "LayoutOrder", "resolve_layout"]

#: The logical dims, in logical order.
LOGICAL_DIMS: Final[str] = "LBHNC"


class LayoutOrder(str, Enum):
    """The six named physical orders of the logical ``[L, B, H, N, C]`` cache."""

    LBNHC = "LBNHC"  # default: per layer, blocks outer, NHD inside a block
    LBHNC = "LBHNC"  # per layer, HND inside a block
    LHBNC = "LHBNC"  # per layer, heads outermost (head-sharded transfer)
    BLNHC = "BLNHC"  # cross-layer: all layers of a block contiguous, NHD
    BLHNC = "BLHNC"  # cross-layer, HND
    BHLNC = "BHLNC"  # cross-layer, heads outer within a block

    @classmethod
    def parse(cls, value: object) -> LayoutOrder:
        if isinstance(value, LayoutOrder):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise ValueError(
                f"layout order {value!r} is not one of {[o.value for o in cls]}"
            ) from None

    @property
    def permutation(self) -> tuple[int, ...]:
        """For each physical dim, the index of the logical dim it holds (``tensor.permute`` order)."""
        return tuple(LOGICAL_DIMS.index(d) for d in self.value)

    @property
    def layer_outer(self) -> bool:
        """``L`` is outermost: each layer slot can be allocated as its own tensor."""
        return self.value[0] == "L"

    @property
    def cross_layer(self) -> bool:
        """``B`` is outermost: one block of all layers is contiguous (one slab for all layers)."""
        return self.value[0] == "B"

    @property
    def page_contiguous(self) -> bool:
        """One block of one layer (``H``, ``N``, ``C``) is one contiguous range (and can be padded)."""
        return set(self.value[-3:]) == {"H", "N", "C"}

    @property
    def splits_into_kernel_blocks(self) -> bool:
        """A manager block of this order can be viewed as ``k`` kernel blocks with no copy (when
        pages are not padded): see :mod:`kv_spec.pages`."""
        return self.value in pages.SPLITTABLE_ORDERS

    @property
    def token_major(self) -> bool:
        """Tokens outside heads inside a block (``NHD``, what FlexAttention and vLLM's default use)."""
        return self.value.index("N") < self.value.index("H")


class LayoutChoice(NamedTuple):
    """What :func:`resolve_layout` picked and why."""

    order: LayoutOrder
    reason: str


def resolve_layout(
    *,
    override: LayoutOrder | str | None = None,
    backend_required: LayoutOrder | str | None = None,
    backend_supported: tuple[LayoutOrder | str, ...] | None = None,
    connector_preferred: LayoutOrder | str | None = None,
    default: LayoutOrder | str = LayoutOrder.LBNHC,
) -> LayoutChoice:
    """Pick the physical order: explicit override > backend requirement > connector preference > default.

    ``backend_supported`` (all orders the backends can read, ``None`` = all) bounds every choice;
    an override or requirement outside it raises, a connector preference outside it is passed over
    and the reason says so.
    """
    supported = (
        tuple(LayoutOrder)
        if backend_supported is None
        else tuple(LayoutOrder.parse(o) for o in backend_supported)
    )
    if not supported:
        raise ValueError("backend_supported is empty: no backend can read any layout order")
    names = [o.value for o in supported]
    required = None if backend_required is None else LayoutOrder.parse(backend_required)
    if required is not None and required not in supported:
        raise ValueError(
            f"backend_required={required.value} is not among backend_supported={names}"
        )
    if override is not None:
        chosen = LayoutOrder.parse(override)
        if required is not None and chosen is not required:
            raise ValueError(
                f"layout override {chosen.value} conflicts with the backend's required layout "
                f"{required.value}; drop the override or pick a backend that reads {chosen.value}"
            )
        if chosen not in supported:
            raise ValueError(
                f"layout override {chosen.value} is not readable by the selected backends "
                f"(they support {names}); pick one of those"
            )
        return LayoutChoice(chosen, f"{chosen.value}: explicit override")
    preferred = None if connector_preferred is None else LayoutOrder.parse(connector_preferred)
    if required is not None:
        note = ""
        if preferred is not None and preferred is not required:
            note = f"; connector preference {preferred.value} not honoured"
        return LayoutChoice(required, f"{required.value}: required by the attention backend{note}")
    if preferred is not None:
        if preferred in supported:
            return LayoutChoice(preferred, f"{preferred.value}: preferred by the connector")
        fallback = _default_in(LayoutOrder.parse(default), supported)
        return LayoutChoice(
            fallback,
            f"{fallback.value}: connector preference {preferred.value} is not readable by the "
            f"backends (they support {names}); using the default",
        )
    chosen = _default_in(LayoutOrder.parse(default), supported)
    why = (
        "default"
        if chosen.value == LayoutOrder.parse(default).value
        else f"first order the backends support ({names})"
    )
    return LayoutChoice(chosen, f"{chosen.value}: {why}")


def _default_in(default: LayoutOrder, supported: tuple[LayoutOrder, ...]) -> LayoutOrder:
    return default if default in supported else supported[0]
