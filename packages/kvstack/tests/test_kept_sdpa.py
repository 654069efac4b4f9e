"""The engine's kept decode gather (``KeptGatherSDPAImpl``, moved here from kv-backends' TORCH_SDPA,
which keeps nothing): each layer keeps its last decode step's gathered K/V and regathers only the
rows that changed (new tokens, moved indices). Every step's output must equal, bit for bit, the
reference TORCH_SDPA impl's over the same cache, and the kept buffer the full gather; the steps
below also check that the partial update was taken where it should be, and not taken after a
write the impl did not make. A planted bug (written slots not refreshed) proves the equality
check fails on stale rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from kv_backends import CommonAttentionMetadata, get_backend
from kv_backends.backends.torch_sdpa import TorchSDPAImpl, TorchSDPAMetadata
from kv_backends.registry import backend_names
from kv_backends.testing import PagedBatch, make_paged_batch
from kv_kernels import layer_view
from kvstack.engine import kept_sdpa
from kvstack.engine.kept_sdpa import (
    EngineImpls,
    KeptGatherSDPAImpl,
    KeptGatherSteps,
    kept_gather_budget,
)

BLOCK = 16
NUM_BLOCKS = 96


def kept_gather(impl: TorchSDPAImpl) -> kept_sdpa.KeptGather | None:
    assert isinstance(impl, KeptGatherSDPAImpl)
    return impl.kept_gather


class _Run:
    """Two layers (layer views 0 and 1 of one storage, so one shared version counter) stepping
    decode batches: each step writes every layer's new K/V through the impl, then attends, and
    compares with the reference impl (which keeps nothing) on fresh metadata."""

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
        self.steps = KeptGatherSteps()  # shared by the layers, as the engine's are
        with torch.inference_mode(inference):
            self.caches[1].copy_(torch.randn(self.caches[1].shape, generator=self.gen))
        self.impls: list[TorchSDPAImpl] = [self._impl() for _ in range(2)]
        bt = b.common.block_table
        self.tables = {
            r: bt[r, : -(-s // BLOCK)].tolist() for r, s in enumerate(seq_lens)
        }  # request -> its blocks
        self.lens = dict(enumerate(seq_lens))  # request -> tokens already in the cache
        used = {x for row in self.tables.values() for x in row}
        self.free = [x for x in range(NUM_BLOCKS) if x not in used]
        random.Random(seed).shuffle(self.free)
        self.partial_steps = 0  # layer-steps that took the partial update

    def _impl(self) -> KeptGatherSDPAImpl:
        return KeptGatherSDPAImpl(
            self.b.config, self.b.layout, keep_decode_gather_bytes=self.budget, steps=self.steps
        )

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
            reference = get_backend("TORCH_SDPA").make_impl(self.b.config, self.b.layout)
            want = reference.forward(None, q, cache, self._build(common))
            assert torch.equal(got, want), f"step of {order}: kept gather differs"
            kept = getattr(impl, "kept_gather", None)
            if kept is not None:  # the full gather's rows, padding included
                assert torch.equal(kept.buffer, kept.row_array.index_select(0, kept.index))
        (plan,) = md.plans.values()
        self.partial_steps += sum(v[2] is not None for v in self.steps.refreshes(plan).values())


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
    impl = run.impls[0]
    q = torch.randn(2, impl.num_q_heads, run.b.config.head_size, generator=run.gen)
    md = run._build(common)
    got = impl.forward(None, q, run.caches[0], md)
    reference = get_backend("TORCH_SDPA").make_impl(run.b.config, run.b.layout)
    assert torch.equal(got, reference.forward(None, q, run.caches[0], run._build(common)))
    (plan,) = md.plans.values()
    ((_, _, found),) = run.steps.refreshes(plan).values()
    assert isinstance(found, tuple) and found[0].numel() == 0


def test_planted_bug_stale_written_rows_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the refresh ignores the slots this step wrote, so each layer's new tokens
    keep last step's values in the kept buffer. The bitwise check must fail."""
    real = kept_sdpa.refresh_rows

    def stale(plan, geometry, offsets, previous, slots, known):
        return real(plan, geometry, offsets, previous, None, known)

    monkeypatch.setattr(kept_sdpa, "refresh_rows", stale)
    run = _Run([14, 30, 40, 47])
    run.step([0, 1, 2, 3])
    with pytest.raises(AssertionError, match="kept gather differs"):
        run.step([0, 1, 2, 3])


def test_the_reference_keeps_nothing_and_the_budget_is_checked() -> None:
    """kv-backends' TORCH_SDPA keeps no gather (and takes no option for one) beside a kept
    layer over the same storage; the kept impl's budget must be an int > 0 (a TypeError that
    names the option)."""
    run = _Run([14, 30])
    impl = get_backend("TORCH_SDPA").make_impl(run.b.config, run.b.layout)
    assert isinstance(impl, TorchSDPAImpl)
    kept = run._impl()
    run.impls = [impl, kept]
    run.step([0, 1])
    run.step([0, 1])
    assert not hasattr(impl, "kept_gather")
    assert kept.kept_gather is not None
    with pytest.raises(TypeError, match="keep_decode_gather_bytes"):
        get_backend("TORCH_SDPA").make_impl(run.b.config, run.b.layout, keep_decode_gather_bytes=1)
    for bad in (True, -1, 0, 2.0):
        with pytest.raises(TypeError, match="keep_decode_gather_bytes"):
            KeptGatherSDPAImpl(run.b.config, run.b.layout, keep_decode_gather_bytes=bad)  # type: ignore[arg-type]


def test_a_gather_over_the_budget_is_not_kept() -> None:
    """The budget bounds each layer's kept buffer: a step whose gather is larger uses the shared
    buffer and drops what the layer kept; the outputs stay the full gather's."""
    # rows of 32 floats (128 bytes): 2 (K, V) x requests x 2 heads x 64 padded tokens each, so
    # 4 requests take 128 KiB and 2 take 64 KiB, against an 80 KiB budget
    run = _Run([14, 30, 62, 47], budget=80 * 1024)
    run.step([0, 1, 2, 3])
    assert all(kept_gather(impl) is None for impl in run.impls)
    small = _Run([14, 30], budget=80 * 1024)
    small.step([0, 1])
    small.step([0, 1])
    assert all(kept_gather(impl) is not None for impl in small.impls)
    assert small.partial_steps >= 1
    for _ in range(40):  # request 1 pads to 128 tokens: 96 KiB, over the budget
        small.step([0, 1])
    assert all(kept_gather(impl) is None for impl in small.impls)


def test_inference_tensor_cache_gathers_in_full() -> None:
    """A cache made under inference_mode has no version counter: every step gathers in full
    into the shared buffer, nothing is kept, and the outputs still match."""
    run = _Run([14, 30, 40], inference=True)
    for _ in range(3):
        run.step([0, 1, 2])
    assert run.partial_steps == 0
    assert all(kept_gather(impl) is None for impl in run.impls)


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


def test_the_engine_keeps_gathers_for_torch_sdpa_on_the_cpu_only() -> None:
    """``EngineImpls``: TORCH_SDPA on the CPU becomes ``KeptGatherSDPAImpl``, budgeted at a
    quarter of the cache over the layers (at least 1 MiB a layer), all layers sharing one
    ``KeptGatherSteps``; off the CPU the reference impl itself. Every other registered backend
    gets its own impl with its own ``engine_impl_options`` (TORCH_SDPA's are none now)."""
    assert kept_gather_budget(64 * 2**20, 4) == 4 * 2**20
    assert kept_gather_budget(2**20, 4) == 2**20
    b = make_paged_batch(query_lens=[1], seq_lens=[5], block_size=BLOCK, num_blocks=8)
    sdpa = get_backend("TORCH_SDPA")
    cpu = EngineImpls(device="cpu", kv_cache_bytes=64 * 2**20, num_layers=4)
    impls = [cpu.make_impl(sdpa, b.config, b.layout) for _ in range(2)]
    assert all(isinstance(i, KeptGatherSDPAImpl) for i in impls)
    assert [i.keep_decode_gather_bytes for i in impls] == [4 * 2**20] * 2  # type: ignore[attr-defined]
    assert impls[0].steps is impls[1].steps is cpu.steps  # type: ignore[attr-defined]
    gpu = EngineImpls(device="cuda", kv_cache_bytes=2**30, num_layers=4)
    assert type(gpu.make_impl(sdpa, b.config, b.layout)) is TorchSDPAImpl
    assert (
        sdpa.engine_impl_options(device=torch.device("cpu"), kv_cache_bytes=2**30, num_layers=2)
        == {}
    )
    served = 0
    for name in backend_names():
        backend = get_backend(name)
        if backend.validate(b.config):
            continue  # (cannot serve this layer at all)
        served += 1
        impl = cpu.make_impl(backend, b.config, b.layout)
        assert isinstance(impl, backend.impl_cls)
        opts = backend.engine_impl_options(device=cpu.device, kv_cache_bytes=2**30, num_layers=4)
        for key, value in opts.items():
            assert getattr(impl, key) == value, (name, key)
    assert served >= 2  # TORCH_SDPA and at least one other backend
