"""The handshake: ``KVTransferParams`` and layout conversion between two workers.

A producer hands a consumer its layout JSON and ``compatibility_hash`` (one per registered cache).
The consumer plans how the producer's block rows become its own (:func:`plan_conversion`):

- same hash: bytes move as they are;
- a different physical order (NHD <-> HND inside a page, per-layer <-> cross-layer, padded pages):
  a permutation inside each page;
- block sizes where one divides the other: ``k`` source blocks merge into one, or one splits into ``k``;
- tensor-parallel head splits between different TP sizes (a consumer rank takes a slice of one
  producer rank's heads, or gathers whole producer ranks into its heads; replicated heads are read
  from the producer rank that holds them);

and anything else (different dtype, quant mode, head or latent size, layer count, heads that do
not divide) is refused with a reason (:class:`HandshakeRefused`). Conversions are plain torch on
byte rows (:func:`convert_rows`); they are exact (bytes are moved, never re-encoded).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch
from kv_spec import KVCacheLayout

from kv_connectors.config import check_fingerprint, check_ids, check_int, check_str

__all__ = [
    "HandshakeRefused",
    "KVTransferParams",
    "LayoutConversion",
    "convert_rows",
    "plan_conversion",
]


class HandshakeRefused(ValueError):
    """Two layouts cannot exchange KV; ``reason`` says why (what differs and what would fix it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_OWNER = "KVTransferParams"


def _check_seq(field: str, value: object, item: str) -> tuple[Any, ...]:
    """A list or tuple (a JSON array), never a bare string or another iterable."""
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"{_OWNER}.{field}={value!r} is a {type(value).__name__}; give a list or tuple of "
            f"{item}"
        )
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class KVTransferParams:
    """What a producer returns from ``request_finished`` and a consumer's request carries.

    ``block_ids`` are the producer's block ids of the request's full blocks, in order;
    ``layouts_json``/``compatibility_hashes`` describe each of its registered caches.
    ``host``/``port`` name the producer's side channel; ``tp_rank``/``tp_size`` its TP position;
    ``model_fingerprint`` the model whose KV it serves (``None``: the producer declared none).
    Every field is checked (types, ranges); nothing is converted but lists into tuples.
    """

    request_id: str
    engine_id: str
    transport: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    layouts_json: tuple[str, ...]
    compatibility_hashes: tuple[str, ...]
    tp_rank: int = 0
    tp_size: int = 1
    model_fingerprint: str | None = None

    def __post_init__(self) -> None:
        o = _OWNER
        check_str(o, "request_id", self.request_id, what="the producer's request id")
        check_str(o, "engine_id", self.engine_id, what="the producer's engine id")
        check_str(o, "transport", self.transport, what="'p2p' or 'nixl'")
        check_str(o, "host", self.host, what="the producer's side-channel host")
        check_int(o, "port", self.port, minimum=1, maximum=65535)
        ids = _check_seq("block_ids", self.block_ids, "block ids (ints >= 0)")
        check_ids(o, "block_ids", ids)  # params are built and sliced a few times a step
        layouts = _check_seq("layouts_json", self.layouts_json, "layout JSON strings")
        hashes = _check_seq("compatibility_hashes", self.compatibility_hashes, "hash strings")
        for i, t in enumerate(layouts):
            check_str(o, f"layouts_json[{i}]", t, what="a KVCacheLayout JSON")
        for i, h in enumerate(hashes):
            check_str(o, f"compatibility_hashes[{i}]", h, what="a layout compatibility hash")
        object.__setattr__(self, "block_ids", ids)
        object.__setattr__(self, "layouts_json", layouts)
        object.__setattr__(self, "compatibility_hashes", hashes)
        if len(layouts) != len(hashes) or not layouts:
            raise ValueError(
                f"KVTransferParams has {len(layouts)} layouts and "
                f"{len(hashes)} hashes; give one hash per layout (at least one)"
            )
        check_int(o, "tp_size", self.tp_size, minimum=1)
        check_int(o, "tp_rank", self.tp_rank, minimum=0, maximum=self.tp_size - 1)
        check_fingerprint(o, self.model_fingerprint, required=False)

    def sliced(self, start: int, stop: int) -> KVTransferParams:
        """These params naming ``block_ids[start:stop]``: a run of ids checked already, so not
        checked again (a consumer cuts a request's params twice a load; each full check walked
        every id, ~20 us for 512 on this CPU)."""
        new = copy.copy(self)
        object.__setattr__(new, "block_ids", self.block_ids[start:stop])
        return new

    @classmethod
    def for_layouts(cls, layouts: Sequence[KVCacheLayout], **fields: Any) -> KVTransferParams:
        return cls(
            layouts_json=tuple(lay.to_json() for lay in layouts),
            compatibility_hashes=tuple(lay.compatibility_hash() for lay in layouts),
            **fields,
        )

    def layouts(self) -> tuple[KVCacheLayout, ...]:
        """The producer's layouts, each checked against its declared hash."""
        out = []
        for i, (text, declared) in enumerate(
            zip(self.layouts_json, self.compatibility_hashes, strict=True)
        ):
            try:
                lay = KVCacheLayout.from_json(text)
            except (ValueError, TypeError, json.JSONDecodeError) as exc:
                raise HandshakeRefused(f"producer layout {i} does not parse: {exc}") from exc
            if lay.compatibility_hash() != declared:
                raise HandshakeRefused(
                    f"producer layout {i} hashes to {lay.compatibility_hash()} but was declared "
                    f"{declared}; the producer runs a different kv-spec or sent a corrupt handshake"
                )
            out.append(lay)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "engine_id": self.engine_id,
            "transport": self.transport,
            "host": self.host,
            "port": self.port,
            "block_ids": list(self.block_ids),
            "layouts_json": list(self.layouts_json),
            "compatibility_hashes": list(self.compatibility_hashes),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "model_fingerprint": self.model_fingerprint,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferParams:
        """The params a :meth:`to_dict` made; a missing or unknown key is refused by name."""
        if not isinstance(data, dict):
            raise ValueError(
                f"KVTransferParams.from_dict takes a dict (what to_dict made), got "
                f"{type(data).__name__}"
            )
        known = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = sorted(required - data.keys())
        unknown = sorted(str(k) for k in data.keys() - known)
        if missing or unknown:
            raise ValueError(
                f"KVTransferParams.from_dict: missing keys {missing}, unknown keys {unknown}; "
                f"pass the dict a producer's request_finished returned (keys {sorted(known)})"
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVTransferParams:
        if not isinstance(text, str | bytes):
            raise ValueError(f"KVTransferParams.from_json takes a JSON string, got {type(text)}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"KVTransferParams.from_json: not JSON ({exc})") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class LayoutConversion:
    """How ``src`` block rows become ``dst`` block rows (see :func:`plan_conversion`)."""

    src: KVCacheLayout
    dst: KVCacheLayout
    merge: int  # k source blocks form one destination block (dst block_size = k * src)
    split: int  # one source block forms k destination blocks (src block_size = k * dst)
    src_heads: tuple[int, int]  # [start, stop) of the source heads that move
    dst_head_offset: int  # first destination head they land on
    sources_needed: int  # producer ranks whose heads together fill one destination block
    reason: str

    @property
    def identity(self) -> bool:
        """Rows move as they are (same compatibility hash, all heads)."""
        return (
            self.src.compatibility_hash() == self.dst.compatibility_hash()
            and self.src_heads == (0, self.src.num_kv_heads)
            and self.sources_needed == 1
        )

    def num_dst_blocks(self, num_src_blocks: int) -> int:
        """Destination blocks that ``num_src_blocks`` whole source blocks fill completely."""
        return num_src_blocks * self.split // self.merge

    def usable_src_blocks(self, num_src_blocks: int) -> int:
        """Source blocks that form whole destination blocks (a merge drops a ragged tail)."""
        return num_src_blocks - num_src_blocks % self.merge


def _content_key(lay: KVCacheLayout) -> tuple[object, ...]:
    # Everything that fixes what one token of one head holds, and where its scales sit (in the
    # row or in the page's scale plane); the physical order, block size, head count and page
    # padding may differ (those are converted).
    return (
        lay.dtype,
        lay.kv_quant.value,
        lay.k_range,
        lay.v_range,
        lay.scale_range,
        lay.scale_placement,
    )


def plan_conversion(
    src: KVCacheLayout,
    dst: KVCacheLayout,
    *,
    src_tp: tuple[int, int] = (0, 1),
    dst_tp: tuple[int, int] = (0, 1),
) -> LayoutConversion:
    """Plan how rows of producer layout ``src`` (TP ``(rank, size)``) fill consumer layout ``dst``.

    Raises :class:`HandshakeRefused` with the reason when no exact conversion exists (and
    ``ValueError`` for arguments of the wrong kind: layouts, ``(rank, size)`` pairs).
    """
    for name, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, KVCacheLayout):
            raise TypeError(
                f"plan_conversion: {name} is a {type(lay).__name__}, not a KVCacheLayout"
            )
    for name, tp in (("src_tp", src_tp), ("dst_tp", dst_tp)):
        if not isinstance(tp, tuple | list) or len(tp) != 2:
            raise ValueError(
                f"plan_conversion.{name}={tp!r} must be a (rank, size) pair, e.g. (0, 1)"
            )
        check_int("plan_conversion", f"{name}[1]", tp[1], minimum=1)
        check_int("plan_conversion", f"{name}[0]", tp[0], minimum=0, maximum=tp[1] - 1)
    if _content_key(src) != _content_key(dst):
        raise HandshakeRefused(
            "token content differs: producer stores dtype/quant/K/V/scale ranges/scale placement "
            f"{_content_key(src)}, consumer {_content_key(dst)}; both must run the same KV dtype, "
            "quantization and head sizes"
        )
    if src.num_layers != dst.num_layers:
        raise HandshakeRefused(
            f"producer has {src.num_layers} layer slots, consumer {dst.num_layers}; pipeline "
            "splits that differ are not converted"
        )
    merge = split = 1
    if dst.block_size % src.block_size == 0:
        merge = dst.block_size // src.block_size
    elif src.block_size % dst.block_size == 0:
        split = src.block_size // dst.block_size
    else:
        raise HandshakeRefused(
            f"block sizes {src.block_size} (producer) and {dst.block_size} (consumer) do not "
            "divide each other; use block sizes where one is a multiple of the other"
        )
    heads, offset, sources = _plan_heads(src, dst, src_tp, dst_tp)
    parts = [f"order {src.order.value}->{dst.order.value}"]
    if merge > 1 or split > 1:
        parts.append(f"block size {src.block_size}->{dst.block_size}")
    if (src.num_kv_heads, src_tp[1]) != (dst.num_kv_heads, dst_tp[1]):
        parts.append(f"heads {heads} of TP {src_tp} -> +{offset} of TP {dst_tp}")
    return LayoutConversion(src, dst, merge, split, heads, offset, sources, ", ".join(parts))


def _plan_heads(
    src: KVCacheLayout,
    dst: KVCacheLayout,
    src_tp: tuple[int, int],
    dst_tp: tuple[int, int],
) -> tuple[tuple[int, int], int, int]:
    (rs, ts), (rd, td) = src_tp, dst_tp
    hs, hd = src.num_kv_heads, dst.num_kv_heads
    if ts == td:
        if hs != hd:
            raise HandshakeRefused(
                f"same TP size {ts} but {hs} producer heads vs {hd} consumer heads per rank"
            )
        return (0, hs), 0, 1
    if td > ts:
        if td % ts:
            raise HandshakeRefused(f"consumer TP {td} is not a multiple of producer TP {ts}")
        ratio = td // ts
        want = rd // ratio
        if rs != want:
            raise HandshakeRefused(
                f"consumer rank {rd} of TP {td} reads producer rank {want} of TP {ts}, not {rs}"
            )
        if hs == hd:  # heads replicated on the consumer side: take them all
            return (0, hs), 0, 1
        if hs != hd * ratio:
            raise HandshakeRefused(
                f"producer rank holds {hs} heads; {ratio} consumer ranks of {hd} heads do not "
                "split them evenly"
            )
        start = (rd % ratio) * hd
        return (start, start + hd), 0, 1
    if ts % td:
        raise HandshakeRefused(f"producer TP {ts} is not a multiple of consumer TP {td}")
    ratio = ts // td
    if not rd * ratio <= rs < (rd + 1) * ratio:
        raise HandshakeRefused(
            f"consumer rank {rd} of TP {td} gathers producer ranks "
            f"[{rd * ratio}, {(rd + 1) * ratio}) of TP {ts}, not {rs}"
        )
    if hs == hd:  # replicated on the producer side: any one rank of the group has them all
        return (0, hs), 0, 1
    if hd != hs * ratio:
        raise HandshakeRefused(
            f"consumer rank holds {hd} heads; {ratio} producer ranks of {hs} heads do not fill it"
        )
    return (0, hs), (rs - rd * ratio) * hs, ratio


def _logical(rows: torch.Tensor, lay: KVCacheLayout) -> torch.Tensor:
    """``[n, L, H, N, C_bytes]`` view of byte rows (``[n, L * page_bytes]``) of layout ``lay``
    (a page's data: a scale plane after it is :func:`_plane`'s)."""
    n = rows.shape[0]
    cb = lay.content_size * lay.element_bytes
    h, nt = lay.num_kv_heads, lay.block_size
    pages = rows.view(n, lay.num_layers, lay.page_bytes)[:, :, : nt * h * cb]
    if lay.order.token_major:  # pages are [N, H, C]
        return pages.unflatten(2, (nt, h, cb)).transpose(2, 3)
    return pages.unflatten(2, (h, nt, cb))  # [H, N, C] (head-outer orders gather the same)


def _plane(rows: torch.Tensor, lay: KVCacheLayout) -> torch.Tensor | None:
    """``[n, L, H, N, scale bytes]`` view of the scale planes of byte rows of layout ``lay``
    (``None`` without a plane): each page's ``[H, N, scales]`` after its data, whatever the
    order."""
    geo = lay.scale_plane_geometry
    if geo is None:
        return None
    offset, head_stride, token_stride = geo
    h, nt = lay.num_kv_heads, lay.block_size
    pages = rows.view(rows.shape[0], lay.num_layers, lay.page_bytes)
    return pages[:, :, offset : offset + h * head_stride].unflatten(2, (h, nt, token_stride))


def _regroup(x: torch.Tensor, conv: LayoutConversion) -> torch.Tensor:
    """``[n, L, h, N, bytes]`` source blocks regrouped into destination blocks (tokens of block
    ``j * k + i`` at ``[i * N, (i + 1) * N)`` of a merge; a split the other way)."""
    n, lay, h, nt, cb = x.shape
    if conv.merge > 1:
        k = conv.merge
        x = x.reshape(n // k, k, lay, h, nt, cb).permute(0, 2, 3, 1, 4, 5)
        return x.reshape(n // k, lay, h, k * nt, cb)
    if conv.split > 1:
        k = conv.split
        x = x.reshape(n, lay, h, k, nt // k, cb).permute(0, 3, 1, 2, 4, 5)
        return x.reshape(n * k, lay, h, nt // k, cb)
    return x


def convert_rows(
    rows: torch.Tensor, conv: LayoutConversion, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Turn ``rows`` (``uint8 [n, L * src.page_bytes]``, whole source blocks in request order) into
    destination rows (``uint8 [m, L * dst.page_bytes]``, ``m = conv.num_dst_blocks(n)``).

    With ``out`` the converted heads are written into ``out``'s rows in place (how a consumer
    gathers several producer ranks into one block); otherwise a fresh zero-padded tensor is returned.
    """
    src, dst = conv.src, conv.dst
    n = rows.shape[0]
    if (
        rows.dtype != torch.uint8
        or rows.dim() != 2
        or rows.shape[1] != src.num_layers * src.page_bytes
    ):
        raise ValueError(
            f"rows is {rows.dtype}{list(rows.shape)}; expected uint8 [n, {src.num_layers * src.page_bytes}]"
        )
    if n % conv.merge:
        raise ValueError(f"{n} source blocks do not merge {conv.merge} at a time; pass a multiple")
    rows = rows.contiguous()
    heads = slice(conv.src_heads[0], conv.src_heads[1])
    x = _regroup(_logical(rows, src)[:, :, heads], conv)
    h, m = x.shape[2], x.shape[0]
    if out is None:
        out = torch.zeros(m, dst.num_layers * dst.page_bytes, dtype=torch.uint8, device=rows.device)
    elif tuple(out.shape) != (m, dst.num_layers * dst.page_bytes) or not out.is_contiguous():
        raise ValueError(
            f"out is {list(out.shape)}; expected contiguous [{m}, {dst.num_layers * dst.page_bytes}]"
        )
    to = slice(conv.dst_head_offset, conv.dst_head_offset + h)
    _logical(out, dst)[:, :, to].copy_(x)
    src_plane, dst_plane = _plane(rows, src), _plane(out, dst)
    if src_plane is not None and dst_plane is not None:  # (the content key pairs placements)
        dst_plane[:, :, to].copy_(_regroup(src_plane[:, :, heads], conv))
    return out
