"""TORCH_SDPA, the reference, keeps no state across calls: every forward reads the cache as it is,
so a caller owes it no report of how the cache was written (kvstack's kept decode gather, which
does, lives in kvstack's engine). A write that bypasses torch's version counter (a numpy view, as
NIXL's raw writes would) is read by the next forward; the impl keeps nothing but facts of its
cache geometry and leaves nothing on the cache. A planted bug (a gather reused across calls)
proves the check sees stale rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_backends import get_backend
from kv_backends.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadata
from kv_backends.testing import make_paged_batch

SEQ_LENS = [14, 30, 47]


def _decode_twice_around_a_raw_write(impl_cls: type[TorchSDPAImpl]) -> None:
    """Two decode forwards of ``impl_cls`` over the same step, an unreported raw write to an
    old context position of request 1 between them; each output against a new reference impl's."""
    b = make_paged_batch(query_lens=[1] * len(SEQ_LENS), seq_lens=SEQ_LENS, seed=3)
    backend = get_backend("TORCH_SDPA")
    impl = impl_cls(b.config, b.layout)
    built = set(vars(impl))
    builder = backend.make_builder(b.config, b.layout, max_num_seqs=len(SEQ_LENS))

    def build() -> TorchSDPAMetadata:
        md = builder.build(b.common)
        assert isinstance(md, TorchSDPAMetadata)
        return md

    gen = torch.Generator().manual_seed(5)
    h, d = b.kv_cache.shape[1], b.config.head_size
    key = torch.randn(len(SEQ_LENS), h, d, generator=gen)
    value = torch.randn(len(SEQ_LENS), h, d, generator=gen)
    impl.do_kv_cache_update(None, key, value, b.kv_cache, b.common.slot_mapping)
    md = build()
    first = impl.forward(None, b.q, b.kv_cache, md)
    (plan,) = md.plans.values()
    assert plan.decode_runs  # the decode-only path (DecodeRun), where a kept gather would sit

    block = int(b.common.block_table[1, 0])
    version = b.kv_cache._version
    b.kv_cache[block].numpy()[:, 3] += 1.0  # token 3 of request 1, behind torch's back
    assert b.kv_cache._version == version  # (nothing a ledger could see)
    second = impl.forward(None, b.q, b.kv_cache, build())
    want = backend.make_impl(b.config, b.layout).forward(None, b.q, b.kv_cache, build())
    assert not torch.equal(want[1], first[1])  # the write changes request 1's output
    assert torch.equal(second, want), "a forward did not read the cache as it is"
    # nothing kept but facts of the cache geometry, nothing left on the cache's tensors
    assert set(vars(impl)) - built <= {"_row_offsets", "_rows_of"}
    base = b.kv_cache._base if b.kv_cache._base is not None else b.kv_cache
    assert not vars(base) and not vars(b.kv_cache)


def test_every_forward_reads_the_cache_as_it_is() -> None:
    _decode_twice_around_a_raw_write(TorchSDPAImpl)


class _KeepsItsGather(TorchSDPAImpl):
    """Planted bug: the decode gather of the first call reused by every later one."""

    def decode_gather(self, *args: Any) -> Any:
        if "_planted" not in self.__dict__:
            buffer, _ = super().decode_gather(*args)
            self.__dict__["_planted"] = buffer.clone()
        return self.__dict__["_planted"], None


def test_planted_bug_a_gather_kept_across_calls_is_caught() -> None:
    with pytest.raises(AssertionError, match="did not read the cache as it is"):
        _decode_twice_around_a_raw_write(_KeepsItsGather)
