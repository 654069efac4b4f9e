"""TORCH_SDPA's kept decode gather (``keep_decode_gather_bytes``): each layer keeps its last decode
step's gathered K/V and regathers only the rows that changed (new tokens, moved indices). Every
step's output must equal, bit for bit, a fresh impl's full gather over the same cache; the steps
below also check that the partial update was taken where it should be, and not taken after a
write the backend did not make. A planted bug (written slots not refreshed) proves the equality
check fails on stale rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from kv_backends import CommonAttentionMetadata, get_backend
from kv_backends.backends import torch_sdpa_kept
from kv_backends.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadata
from kv_backends.registry import backend_names
from kv_backends.testing import PagedBatch, make_paged_batch
from kv_kernels import layer_view

BLOCK = 16
NUM_BLOCKS = 96


class _Run:
    """Two layers (layer views 0 and 1 of one storage, so one shared version counter) stepping
    decode batches: each step writes every layer's new K/V through the impl, then attends, and
    compares with a fresh impl (no kept gather) on fresh metadata."""

    def __init__(
        self, seq_lens: list[int], seed: int = 0, inference: bool = False, budget: int = 2**30
    ) -> None:
        self.budget = budget
        self.b: PagedBatch = make_paged_batch(
            query_lens=[1] * len(seq_lens), seq_lens=seq_lens, num_layers=2,
            block_size=BLOCK, num_blocks=NUM_BLOCKS, seed=seed,
        )  # fmt: skip
        b = self.b
        storage = b.storage
        if inference:  # an inference tensor: no version counter, so nothing is ever reused
            with torch.inference_mode():
                if isinstance(storage, list):
                    storage = [t.clone() for t in storage]
                else:
                    storage = storage.clone()  # type: ignore[attr-defined]
        self.inference = inference
        self.caches = [layer_view(storage, b.layout, i) for i in (0, 1)]  # type: ignore[arg-type]
        self.gen = torch.Generator().manual_seed(seed + 1)
        with torch.inference_mode(inference):
            self.caches[1].copy_(torch.randn(self.caches[1].shape, generator=self.gen))
        self.impls = [self._impl() for _ in range(2)]
        bt = b.common.block_table
        self.tables = {
            r: bt[r, : -(-s // BLOCK)].tolist() for r, s in enumerate(seq_lens)
        }  # request -> its blocks
        self.lens = dict(enumerate(seq_lens))  # request -> tokens already in the cache
        used = {x for row in self.tables.values() for x in row}
        self.free = [x for x in range(NUM_BLOCKS) if x not in used]
        random.Random(seed).shuffle(self.free)
        self.partial_steps = 0  # layer-steps that took the partial update

    def _impl(self) -> TorchSDPAImpl:
        impl = get_backend("TORCH_SDPA").make_impl(
            self.b.config, self.b.layout, keep_decode_gather_bytes=self.budget
        )
        assert isinstance(impl, TorchSDPAImpl)
        return impl

    def _build(self, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        builder = get_backend("TORCH_SDPA").builder_cls(
            self.b.config, self.b.layout, device=torch.device("cpu"),
            max_num_batched_tokens=256, max_num_seqs=16,
        )  # fmt: skip
        md = builder.build(common)
        assert isinstance(md, TorchSDPAMetadata)
        return md

    def step(self, order: list[int], between: object = None) -> None:
        """One decode step of requests ``order`` (in that row order), each one token longer;
        ``between(layer_cache)`` runs after a layer's write, before its attention."""
        with torch.inference_mode(self.inference):
            self._step(order, between)

    def _step(self, order: list[int], between: object) -> None:
        seq = []
        for r in order:
            self.lens[r] += 1
            while len(self.tables[r]) * BLOCK < self.lens[r]:
                self.tables[r].append(self.free.pop())
            seq.append(self.lens[r])
        width = max(len(self.tables[r]) for r in order)
        rows = [self.tables[r] + [0] * (width - len(self.tables[r])) for r in order]
        common = CommonAttentionMetadata.from_lists(
            query_lens=[1] * len(order), seq_lens=seq, block_table=rows, block_size=BLOCK
        )
        md = self._build(common)
        h, d, hq = self.caches[0].shape[1], self.b.config.head_size, self.impls[0].num_q_heads
        for impl, cache in zip(self.impls, self.caches, strict=True):
            k = torch.randn(len(order), h, d, generator=self.gen)
            v = torch.randn(len(order), h, d, generator=self.gen)
            q = torch.randn(len(order), hq, d, generator=self.gen)
            impl.do_kv_cache_update(None, k, v, cache, common.slot_mapping)
            if callable(between):
                between(cache)
            got = impl.forward(None, q, cache, md)
            fresh = self._impl()  # nothing kept yet: a full gather
            want = fresh.forward(None, q, cache, self._build(common))
            assert torch.equal(got, want), f"step of {order}: kept gather differs"
            kept = impl.kept_gather
            if kept is not None:
                assert torch.equal(kept.buffer, fresh.kept_gather.buffer)
        (plan,) = md.plans.values()
        self.partial_steps += sum(v[2] is not None for v in plan.refreshes.values())


def test_consecutive_decode_steps_match_the_full_gather() -> None:
    """Steps of the same requests, each one token longer: crossing block boundaries (a block
    appended) and a padding bucket (64 -> 128 tokens: the index shape changes, a full gather)."""
    run = _Run([14, 30, 62, 47])
    for _ in range(6):  # 14 -> 20 crosses 16, 62 -> 68 crosses 64 (a bucket change)
        run.step([0, 1, 2, 3])
    # first step: nothing kept; the bucket change: a full gather; the rest partial
    assert run.partial_steps >= 3


def test_requests_leaving_joining_and_reordered_match_the_full_gather() -> None:
    run = _Run([14, 30, 40, 47, 9])
    run.step([0, 1, 2, 3])
    run.step([0, 1, 2, 3])
    run.step([0, 2, 3])  # request 1 finished
    run.step([0, 2, 3, 4])  # request 4 joins
    run.step([3, 0, 4, 2])  # rows reordered
    run.step([3, 0, 4, 2])
    assert run.partial_steps >= 1


def test_a_write_the_backend_did_not_make_forces_a_full_gather() -> None:
    """An in-place write to an old context position between steps (after this step's own
    cache write, and before it) must be seen: the kept rows would be stale."""
    run = _Run([14, 30, 40, 47])
    run.step([0, 1, 2, 3])
    run.step([0, 1, 2, 3])
    old_block = run.tables[1][0]

    def scribble(cache: torch.Tensor) -> None:
        cache[old_block, :, 3] += 1.0  # token 3 of request 1, an old context position

    run.step([0, 1, 2, 3], between=scribble)
    run.caches[0][run.tables[2][0], :, 5] -= 2.0  # between steps, outside the backend
    run.step([0, 1, 2, 3])
    run.step([0, 1, 2, 3])


def test_no_write_since_the_last_gather_regathers_nothing() -> None:
    """A layer that attends twice over the same step's metadata (no write in between) reuses
    its whole buffer: nothing changed, nothing regathered, the same bits."""
    run = _Run([14, 30])
    run.step([0, 1])
    width = max(len(run.tables[0]), len(run.tables[1]))
    common = CommonAttentionMetadata.from_lists(
        query_lens=[1, 1],
        seq_lens=[run.lens[0], run.lens[1]],
        block_table=[run.tables[r] + [0] * (width - len(run.tables[r])) for r in (0, 1)],
        block_size=BLOCK,
    )
    impl: TorchSDPAImpl = run.impls[0]  # type: ignore[assignment]
    q = torch.randn(2, impl.num_q_heads, run.b.config.head_size, generator=run.gen)
    md = run._build(common)
    got = impl.forward(None, q, run.caches[0], md)
    fresh = run._impl()
    assert torch.equal(got, fresh.forward(None, q, run.caches[0], run._build(common)))
    (plan,) = md.plans.values()
    ((_, _, found),) = plan.refreshes.values()
    assert found is not None and found[0].numel() == 0


def test_planted_bug_stale_written_rows_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the refresh ignores the slots this step wrote, so each layer's new tokens
    keep last step's values in the kept buffer. The bitwise check must fail."""
    real = torch_sdpa_kept.refresh_rows

    def stale(plan, geometry, offsets, previous, slots):  # type: ignore[no-untyped-def]
        return real(plan, geometry, offsets, previous, None)

    monkeypatch.setattr(torch_sdpa_kept, "refresh_rows", stale)
    run = _Run([14, 30, 40, 47])
    run.step([0, 1, 2, 3])
    with pytest.raises(AssertionError, match="kept gather differs"):
        run.step([0, 1, 2, 3])


def test_off_by_default_and_checked() -> None:
    """Without the option nothing is kept and no ledger is made; a bool or a negative size is a
    TypeError that names the option."""
    run = _Run([14, 30])
    impl = get_backend("TORCH_SDPA").make_impl(run.b.config, run.b.layout)
    run.impls = [impl, run._impl()]
    run.step([0, 1])
    run.step([0, 1])
    assert impl.kept_gather is None
    assert run.impls[1].kept_gather is not None
    for bad in (True, -1, 2.0):
        with pytest.raises(TypeError, match="keep_decode_gather_bytes"):
            get_backend("TORCH_SDPA").make_impl(
                run.b.config, run.b.layout, keep_decode_gather_bytes=bad
            )


def test_a_gather_over_the_budget_is_not_kept() -> None:
    """The budget bounds each layer's kept buffer: a step whose gather is larger uses the shared
    buffer and drops what the layer kept; the outputs stay the full gather's."""
    # rows of 32 floats (128 bytes): 2 (K, V) x requests x 2 heads x 64 padded tokens each, so
    # 4 requests take 128 KiB and 2 take 64 KiB, against an 80 KiB budget
    run = _Run([14, 30, 62, 47], budget=80 * 1024)
    run.step([0, 1, 2, 3])
    assert all(impl.kept_gather is None for impl in run.impls)
    small = _Run([14, 30], budget=80 * 1024)
    small.step([0, 1])
    small.step([0, 1])
    assert all(impl.kept_gather is not None for impl in small.impls)
    assert small.partial_steps >= 1
    for _ in range(40):  # request 1 pads to 128 tokens: 96 KiB, over the budget
        small.step([0, 1])
    assert all(impl.kept_gather is None for impl in small.impls)


def test_inference_tensor_cache_gathers_in_full() -> None:
    """A cache made under inference_mode has no version counter: every step gathers in full
    into the shared buffer, nothing is kept, and the outputs still match."""
    run = _Run([14, 30, 40], inference=True)
    for _ in range(3):
        run.step([0, 1, 2])
    assert run.partial_steps == 0
    assert all(impl.kept_gather is None for impl in run.impls)


def test_raw_writes_need_increment_version() -> None:
    """A write that bypasses torch's version counter (a numpy view over the cache) is invisible
    to the ledger, which is why the option is off by default; reporting it with
    torch.autograd.graph.increment_version makes the next step gather in full."""
    run = _Run([14, 30, 40, 47])
    run.step([0, 1, 2, 3])
    run.step([0, 1, 2, 3])
    block = run.tables[1][0]

    def raw(cache: torch.Tensor) -> None:
        cache[block].numpy()[:, 3] += 1.0  # token 3 of request 1; no version bump
        torch.autograd.graph.increment_version(cache)

    run.step([0, 1, 2, 3], between=raw)

    def unreported(cache: torch.Tensor) -> None:
        cache[block].numpy()[:, 4] += 1.0

    with pytest.raises(AssertionError, match="kept gather differs"):
        run.step([0, 1, 2, 3], between=unreported)


def test_engine_options_budget_the_kept_gathers_on_the_cpu_only() -> None:
    """What an engine that reports external writes passes: a quarter of the cache over the
    layers, at least 1 MiB a layer, on the CPU; nothing on a GPU. Every registered backend's
    options are accepted by its own ``make_impl`` (the hook's contract)."""
    sdpa = get_backend("TORCH_SDPA")
    cpu = torch.device("cpu")
    assert sdpa.engine_impl_options(device=cpu, kv_cache_bytes=64 * 2**20, num_layers=4) == {
        "keep_decode_gather_bytes": 4 * 2**20
    }
    assert sdpa.engine_impl_options(device=cpu, kv_cache_bytes=2**20, num_layers=4) == {
        "keep_decode_gather_bytes": 2**20
    }
    assert (
        sdpa.engine_impl_options(device=torch.device("cuda"), kv_cache_bytes=2**30, num_layers=4)
        == {}
    )
    b = make_paged_batch(query_lens=[1], seq_lens=[5], block_size=BLOCK, num_blocks=8)
    served = 0
    for name in backend_names():
        backend = get_backend(name)
        opts = backend.engine_impl_options(device=cpu, kv_cache_bytes=2**30, num_layers=2)
        if backend.validate(b.config):
            continue  # (cannot serve this layer at all)
        served += 1
        impl = backend.make_impl(b.config, b.layout, **opts)
        for key, value in opts.items():
            assert getattr(impl, key) == value, (name, key)
    assert served >= 2  # TORCH_SDPA and at least one other backend took their options
