"""paged_attention's cached path on the CPU: tensors seen as ``cuda:0``, Triton launches stubbed
(kv_kernels.testing_launch). The GPU half, bit for bit on the device: test_fast_launch_gpu.py.

- A call bound per shape class (paged_attention._bound) launches exactly what the uncached path
  launches (the api's checks and plan every call, ``kernel[grid]``): the same kernels, grids and
  values, each pointer at the same input and offset (or the same per-call allocation), over
  decode with and without KV splits (fixed and by ``max_seq_len``), LSE, sinks / ALiBi / soft-cap /
  window / error flag, fp8 scales as floats and tensors, inline per-token-head scales, MLA,
  prefill, and the sm_90 Gluon decode and MLA kernels.
- Check mode compares every bound call with the described path and raises on a planted mismatch.
- Every input that differs from the bound class in a checked property misses and raises the full
  path's error; a planted key bug (q's dtype dropped) is caught by the same helper.
- The split table found by bisection equals the split heuristics over a sweep of ``max_seq_len``
  (and a planted non-monotone heuristic shows the sweep can fail).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from kv_kernels import _call_cache, _launch, testing_launch
from kv_kernels.cache import allocate_kv_cache, layer_view
from kv_kernels.paged_attention import paged_attention
from kv_kernels.testing_launch import fake_cuda, stubbed_cuda
from kv_spec import KVCacheLayout, LayoutOrder

api = importlib.import_module("kv_kernels.paged_attention.api")
fast = importlib.import_module("kv_kernels.paged_attention._fast")
bound_mod = importlib.import_module("kv_kernels.paged_attention._bound")
tri = importlib.import_module("kv_kernels.paged_attention.triton")
tiles = importlib.import_module("kv_kernels.paged_attention._tiles")


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Stubbed CUDA, no validated calls, launches and allocations recorded, and a count of
    full-path checks (``resolve_impl`` runs once per validated call)."""
    monkeypatch.delenv("KV_KERNELS_VALIDATE", raising=False)
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    fast.clear()
    checks = {"n": 0}
    real = api.resolve_impl

    def counted(*a: Any, **kw: Any) -> Any:
        checks["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(api, "resolve_impl", counted)
    with stubbed_cuda():
        yield checks
    fast.clear()


def _layout(**kw: Any) -> KVCacheLayout:
    base: dict[str, Any] = dict(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=12, num_kv_heads=2, block_size=4,
        head_size=16, head_size_v=16, dtype="bfloat16",
    )  # fmt: skip
    base.update(kw)
    return KVCacheLayout(**base)


def _case(
    layout: KVCacheLayout,
    q_lens: tuple[int, ...] = (1, 1, 1),
    seq_len: int = 9,
    heads: int = 4,
    **call: Any,
) -> dict[str, Any]:
    """One call's inputs over ``layout`` (fake-cuda tensors; values are never computed on)."""
    torch.manual_seed(0)
    n = len(q_lens)
    pages = -(-seq_len // layout.block_size)
    kv = layer_view(allocate_kv_cache(layout, "cpu", zero=True), layout, 0)
    qdt = torch.bfloat16
    head = layout.head_size
    q = torch.randn(sum(q_lens), heads, head).to(qdt)
    dv = call.get("kv_lora_rank") or layout.head_size_v
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args: dict[str, Any] = dict(
        q=fake_cuda(q), kv_cache=fake_cuda(kv), layout=layout,
        block_table=fake_cuda(torch.randint(0, layout.num_blocks, (n, pages), dtype=torch.int32)),
        seq_lens=fake_cuda(torch.full((n,), seq_len, dtype=torch.int32)),
        query_start_loc=fake_cuda(qsl), max_query_len=max(q_lens),
        out=fake_cuda(torch.empty(sum(q_lens), heads, dv, dtype=qdt)),
    )  # fmt: skip
    args.update(call)
    return args


def _inputs(args: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}


def _label(ptr: int, named: dict[str, torch.Tensor], allocs: list[torch.Tensor]) -> Any:
    """Which input ``ptr`` points into and where, else which allocation of the call (by its
    size: the LSE and the split scratch differ) and where."""
    for name, t in named.items():
        base = t.untyped_storage().data_ptr()
        if base <= ptr < base + max(t.untyped_storage().nbytes(), 1):
            return (name, ptr - t.data_ptr())
    for t in allocs:
        if t.data_ptr() <= ptr < t.data_ptr() + max(t.untyped_storage().nbytes(), 1):
            return ("alloc", t.untyped_storage().nbytes(), ptr - t.data_ptr())
    return ("unknown", ptr)


def _run(args: dict[str, Any]) -> Any:
    return paged_attention(**args)


def _plain_launches(args: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The uncached path's launches (checks and plan every call, ``kernel[grid]``)."""
    with monkeypatch.context() as m:
        m.setattr(_call_cache, "ENABLED", False)
        m.setattr(_launch, "ENABLED", False)
        plain = _bound_launches(args, [])
    assert plain and not _unknown(plain) and not _pointer_ints(plain)
    return plain


def _bound_launches(args: dict[str, Any], plain: list[Any]) -> list[Any]:
    """A call's launches, each pointer labelled by what it points into (:func:`_label`) as
    ``("ptr", label)`` where it went to the launcher as a tensor, ``("int", label)`` where as an
    int (a bound call; ints are read as pointers at the positions ``plain`` has pointers)."""
    testing_launch.LAUNCHES, testing_launch.ALLOCATIONS = [], []
    try:
        _run(args)
        launches, allocs = testing_launch.LAUNCHES, testing_launch.ALLOCATIONS
    finally:
        testing_launch.LAUNCHES = testing_launch.ALLOCATIONS = None
    named = _inputs(args)
    out = []
    for i, (name, grid, largs) in enumerate(launches):
        pargs = plain[i][2] if i < len(plain) else ()
        labelled = []
        for j, a in enumerate(largs):
            pointer = j < len(pargs) and isinstance(pargs[j], tuple) and pargs[j][:1] == ("ptr",)
            if isinstance(a, torch.Tensor):
                labelled.append(("ptr", _label(a.data_ptr(), named, allocs)))
            elif pointer and type(a) is int:
                labelled.append(("int", _label(a, named, allocs)))
            else:
                labelled.append(a)
        out.append((name, grid, tuple(labelled)))
    assert not _unknown(out)
    return out


def _unknown(launches: list[Any]) -> bool:
    return any(
        isinstance(a, tuple) and a[1][0] == "unknown" for _, _, largs in launches for a in largs
    )


def _same(plain: list[tuple[Any, ...]], bound: list[tuple[Any, ...]]) -> bool:
    """Launch lists alike: kernels, grids, and each argument (pointers by label, passed as a
    tensor or as an int; values by type and value)."""
    if len(plain) != len(bound):
        return False
    for (n1, g1, a1), (n2, g2, a2) in zip(plain, bound, strict=True):
        if n1 != n2 or tuple(g1) != tuple(g2) or len(a1) != len(a2):
            return False
        for x, y in zip(a1, a2, strict=True):
            if isinstance(x, tuple) and x[:1] == ("ptr",):
                if not (isinstance(y, tuple) and y[:1] in (("ptr",), ("int",)) and y[1] == x[1]):
                    return False
            elif x != y or type(x) is not type(y):
                return False
    return True


def _pointer_ints(launches: list[Any]) -> bool:
    """Whether every pointer of ``launches`` went to the launcher as an int (a bound call)."""
    kinds = {a[0] for _, _, largs in launches for a in largs if isinstance(a, tuple)}
    return kinds == {"int"}


FP8 = dict(dtype="float8_e4m3fn", kv_quant="fp8_per_tensor")
CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "decode": lambda: _case(_layout(), num_splits=1),
    "decode_split_fixed": lambda: _case(_layout(), num_splits=4),
    "decode_split_heuristic": lambda: _case(_layout(), seq_len=300, max_seq_len=300),
    "decode_no_max_seq_len": lambda: _case(_layout(), seq_len=300),
    "lse_split": lambda: _case(_layout(), num_splits=2, return_lse=True),
    "features": lambda: _case(
        _layout(),
        num_splits=2,
        sinks=fake_cuda(torch.randn(4)),
        softcap=30.0,
        alibi_slopes=fake_cuda(torch.rand(4)),
        sliding_window=5,
        error_flag=fake_cuda(torch.zeros(1, dtype=torch.int32)),
        scale=0.3,
    ),
    "fp8_float_scales": lambda: _case(_layout(**FP8), k_scale=0.5, v_scale=0.25, num_splits=1),
    "fp8_tensor_scales": lambda: _case(
        _layout(**FP8),
        k_scale=fake_cuda(torch.full((2,), 0.5)),
        v_scale=fake_cuda(torch.full((1,), 0.25)),
        num_splits=2,
    ),
    "fp8_mixed_scales": lambda: _case(
        _layout(**FP8), k_scale=fake_cuda(torch.full((2,), 0.5)), v_scale=0.25, num_splits=1
    ),
    "int8_inline_scales": lambda: _case(
        _layout(dtype="int8", kv_quant="int8_per_token_head"), num_splits=2
    ),
    "prefill_mixed": lambda: _case(_layout(), q_lens=(1, 7, 1), seq_len=9),
    "mla": lambda: _case(
        KVCacheLayout.from_spec(_mla_spec(), num_blocks=12, num_layers=1),
        heads=4,
        kv_lora_rank=32,
        num_splits=2,
    ),
    # an fp8 latent: one scale, k_scale, that V reads too (v_scale stays None)
    "mla_fp8_float_scale": lambda: _case(
        KVCacheLayout.from_spec(_mla_spec(**FP8), num_blocks=12, num_layers=1),
        heads=4,
        kv_lora_rank=32,
        k_scale=0.5,
        num_splits=2,
    ),
    "mla_fp8_tensor_scale": lambda: _case(
        KVCacheLayout.from_spec(_mla_spec(**FP8), num_blocks=12, num_layers=1),
        heads=4,
        kv_lora_rank=32,
        k_scale=fake_cuda(torch.full((1,), 0.5)),
        max_seq_len=9,
    ),
}


def _mla_spec(**kw: Any) -> Any:
    from kv_spec import MLAAttentionSpec

    return MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=48, **(kw or FP16))


FP16 = dict(dtype="bfloat16")


#: cases whose bound call is refused by design (the described path serves every call)
UNBOUND = {"fp8_mixed_scales": "a float partner of a tensor scale becomes a new tensor a call"}


@pytest.mark.parametrize("case", list(CASES))
def test_bound_calls_launch_what_the_uncached_path_launches(
    stub: Any, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = CASES[case]()
    plain = _plain_launches(args, monkeypatch)
    first = stub["n"]
    for _ in range(3):  # validated and bound, then two bound calls
        got = _bound_launches(args, plain)
        assert _same(plain, got), f"{case}: {got} != {plain}"
    assert stub["n"] == first + 1  # (one validation: the later calls were hits)
    assert _pointer_ints(got) is (case not in UNBOUND)


def test_classes_of_one_structure_share_the_bound_source_and_launch_their_own_values(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step with a new token count is a new shape class, bound anew; its generated source is
    that of every class with the same launches (the values live in the class's namespace), so
    it is compiled once (``compile`` was ~1 ms of each build on a slow CPU). Each class must
    still launch its own grid and arguments: the uncached path's, call by call. Planted: a
    cache that kept the first class's namespace would launch batch 3's grid for batch 4."""
    compiled: list[str] = []
    real = compile

    def counting(source: str, *a: Any) -> Any:
        compiled.append(source)
        return real(source, *a)

    monkeypatch.setattr(bound_mod, "compile", counting, raising=False)
    monkeypatch.setattr(bound_mod, "_CODE", {})
    layout = _layout()
    for q_lens in ((1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1, 1)):
        args = _case(layout, q_lens=q_lens)
        plain = _plain_launches(args, monkeypatch)
        for _ in range(3):
            got = _bound_launches(args, plain)
            assert _same(plain, got), f"{q_lens}: {got} != {plain}"
        assert _pointer_ints(got)  # (bound: pointers went as ints)
    assert len(compiled) == len(set(compiled)) == len(bound_mod._CODE) >= 1
    assert len(compiled) < 3  # at least two of the three classes shared a source


def test_a_planted_argument_swap_in_a_bound_call_is_caught(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison above fails when a bound call maps a pointer to the wrong input."""
    args = CASES["decode_split_fixed"]()
    plain = _plain_launches(args, monkeypatch)
    _run(args)
    entry = next(iter(fast._ENTRIES.values()))
    bc = next(iter(entry.bound.values()))
    real = bc.launch

    def swapped(*slots: Any) -> Any:  # seq_lens and query_start_loc exchanged
        q, kv_cache, block_table, seq_lens, query_start_loc, *rest = slots
        return real(q, kv_cache, block_table, query_start_loc, seq_lens, *rest)

    monkeypatch.setattr(bc, "launch", swapped)
    assert not _same(plain, _bound_launches(args, plain))


@pytest.mark.parametrize(
    "case", ["decode_split_heuristic", "lse_split", "features", "mla", "mla_fp8_tensor_scale"]
)
def test_check_mode_compares_each_bound_call_with_the_described_path(
    stub: Any, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_launch, "CHECK", True)
    args = CASES[case]()
    for _ in range(3):
        _run(args)
    entry = next(iter(fast._ENTRIES.values()))
    bc = next(b for b in entry.bound.values() if b)
    consts = bc.launch.__globals__
    name = next(k for k, v in consts.items() if k.startswith("c") and v == 1)
    monkeypatch.setitem(consts, name, 2)  # a planted constant: an int argument off by one
    arguments = bc.arguments.__globals__
    assert arguments is consts
    with pytest.raises(_launch.LaunchMismatch, match="differs from the described path"):
        _run(args)


# A bad variant of one input per checked property: each must miss and raise the full path's
# error (a key that ignored the property would launch it instead).
def _bad(args: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    q, out, bt = args["q"], args["out"], args["block_table"]
    sl, qsl = args["seq_lens"], args["query_start_loc"]
    return [
        ("q dtype", {"q": fake_cuda(q.float())}, "must match the unquantized cache"),
        ("q heads", {"q": fake_cuda(q[:, :3])}, "multiple of layout.num_kv_heads"),
        ("kv shape", {"kv_cache": fake_cuda(args["kv_cache"][:4])}, "layer view"),
        ("table dtype", {"block_table": fake_cuda(bt.float())}, "block_table must be"),
        ("table rows", {"block_table": fake_cuda(bt[:2])}, "seq_lens must be"),
        ("seq_lens dtype", {"seq_lens": fake_cuda(sl.float())}, "seq_lens must be"),
        ("seq_lens device", {"seq_lens": sl.clone()}, "is on cpu"),
        ("qsl shape", {"query_start_loc": fake_cuda(qsl[:3])}, "query_start_loc must be"),
        ("out dtype", {"out": fake_cuda(out.float())}, "out must be"),
        ("out shape", {"out": fake_cuda(out[:, :2])}, "out must be"),
        ("causal type", {"causal": 1}, "must be a bool"),
        ("window", {"sliding_window": 0}, "sliding_window=0"),
        ("splits", {"num_splits": 0}, "num_splits=0"),
        ("scale", {"scale": float("nan")}, "finite float"),
        ("softcap", {"softcap": -1.0}, "softcap"),
        ("max_seq_len", {"max_seq_len": -1}, "max_seq_len=-1"),
        ("max_query_len", {"max_query_len": 1.0}, "max_query_len=1.0"),
        ("sinks", {"sinks": fake_cuda(torch.zeros(3))}, "sinks must be"),
        ("flag", {"error_flag": fake_cuda(torch.zeros(2, dtype=torch.int32))}, "error_flag"),
        ("seq_lens stride", {"seq_lens": fake_cuda(sl.repeat_interleave(2)[::2])}, "stride 2"),
        ("qsl stride", {"query_start_loc": fake_cuda(qsl.repeat_interleave(2)[::2])}, "stride 2"),
        ("sinks stride", {"sinks": fake_cuda(torch.zeros(8)[::2])}, "stride 2"),
    ]


def _bad_inputs_raise(args: dict[str, Any]) -> list[str]:
    """After a bound call, the names of the bad variants that did not raise their error."""
    for _ in range(3):
        _run(args)
    missed = []
    for name, change, message in _bad(args):
        try:
            _run({**args, **change})
        except (ValueError, TypeError) as e:
            if message not in str(e):
                raise
            continue
        missed.append(name)
    return missed


def test_any_input_unlike_the_bound_class_misses_and_raises_the_full_paths_error(
    stub: Any,
) -> None:
    assert _bad_inputs_raise(_case(_layout(), num_splits=2)) == []


def test_a_planted_key_without_qs_dtype_is_caught(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    class NoQDtype(dict):  # the cache's dict, keys with q's dtype (key[6]) blanked
        def get(self, key: Any, default: Any = None) -> Any:
            return super().get((*key[:6], None, *key[7:]), default)

        def __setitem__(self, key: Any, value: Any) -> None:
            super().__setitem__((*key[:6], None, *key[7:]), value)

    monkeypatch.setattr(fast, "_ENTRIES", NoQDtype())
    fast.clear()
    assert _bad_inputs_raise(_case(_layout(), num_splits=2)) == ["q dtype"]


def test_validate_modes_and_the_switches_take_the_full_path(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _case(_layout(), num_splits=1)
    for _ in range(3):
        _run(args)
    assert stub["n"] == 1
    _run({**args, "validate": True})
    monkeypatch.setenv("KV_KERNELS_VALIDATE", "1")
    _run(args)
    monkeypatch.delenv("KV_KERNELS_VALIDATE")
    monkeypatch.setattr(_call_cache, "ENABLED", False)
    _run(args)
    assert stub["n"] == 4
    monkeypatch.setattr(_call_cache, "ENABLED", True)
    monkeypatch.setenv("KV_KERNELS_SM90_DECODE", "0")  # (a Gluon switch: another key)
    _run(args)
    assert stub["n"] == 5


def test_a_reset_or_a_hook_sends_bound_calls_back_to_the_described_path(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _case(_layout(), num_splits=2)
    plain = _plain_launches(args, monkeypatch)
    for _ in range(2):
        _run(args)
    assert _pointer_ints(_bound_launches(args, plain))
    _launch.reset_all()  # (bound launches forgotten: plain, then bound again)
    assert not _pointer_ints(_bound_launches(args, plain))
    assert _pointer_ints(_bound_launches(args, plain))
    monkeypatch.setattr(_launch, "_hooks_idle", lambda: False)  # a profiler's hook
    got = _bound_launches(args, plain)
    assert _same(plain, got) and not _pointer_ints(got)


def test_two_inputs_that_are_one_tensor_are_never_bound(
    stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sinks and ALiBi slopes as one tensor: a later call may pass two, so no bound call."""
    slopes = fake_cuda(torch.rand(4))
    args = _case(_layout(), num_splits=1, sinks=slopes, alibi_slopes=slopes)
    plain = _plain_launches(args, monkeypatch)
    for _ in range(3):
        got = _bound_launches(args, plain)
    assert _same(plain, got) and not _pointer_ints(got)


def _gluon_case(kind: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A call the sm_90 Gluon ``kind`` kernel serves on a card whose kernels run compiled:
    "decode": fp8 pages at heads 128; "mla": a 512 + 64 latent at 128 heads; "mla16": at 16
    (the narrow MLA kernel)."""
    monkeypatch.setattr(tri, "paged_attention_kernel", object())  # (compiled, not interpreted)
    if kind == "decode":
        layout = _layout(num_kv_heads=2, head_size=128, head_size_v=128, block_size=16, **FP8)
        return _case(layout, heads=8, seq_len=40, k_scale=0.5, v_scale=0.5, max_seq_len=40)
    from kv_spec import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    layout = KVCacheLayout.from_spec(spec, num_blocks=8, num_layers=1)
    heads = 16 if kind == "mla16" else 128
    return _case(layout, heads=heads, seq_len=40, kv_lora_rank=512, max_seq_len=40)


@pytest.mark.parametrize("kind", ["decode", "mla", "mla16"])
def test_the_sm90_gluon_kernels_bind_too(
    stub: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gluon decode, MLA and narrow MLA kernels' calls bind as the Triton kernel's do."""
    args = _gluon_case(kind, monkeypatch)
    plain = _plain_launches(args, monkeypatch)
    want = {"decode": "sm90_decode", "mla": "sm90_mla_kernel", "mla16": "sm90_mla_narrow"}[kind]
    assert plain[0][0].startswith(want), plain[0][0]
    for _ in range(3):
        got = _bound_launches(args, plain)
        assert _same(plain, got)
    assert _pointer_ints(got)


# ---- the split table --------------------------------------------------------------------------


def _heuristics() -> list[Callable[[int], int]]:
    cfg = tiles.select_config(
        "decode", head_size=128, head_size_v=128, group=4, block_size=16, elem_bytes=2,
        arch=90, v_from_k=False,
    )  # fmt: skip

    def at(spec: tuple[Any, ...]) -> Callable[[int], int]:
        return lambda m: tri._num_splits(spec, None, 16, m)

    return [
        at((kind, seqs, heads, 132, cfg))
        for seqs, heads in ((1, 8), (3, 8), (64, 8), (1, 1))
        for kind in ("triton", "decode", "mla")
    ]


def _table_matches(splits_at: Callable[[int], int]) -> bool:
    lows, values = bound_mod.split_steps(splits_at)
    table = bound_mod.SplitTable(None, (lows, values), 0)
    probes = [*range(0, 70_000, 7), *(2**k + d for k in range(17, 31) for d in (-1, 0, 1))]
    return all(table(m) == splits_at(m) for m in probes)


def test_the_split_table_equals_the_heuristics() -> None:
    assert all(_table_matches(f) for f in _heuristics())


def test_a_planted_non_monotone_heuristic_fails_the_table_check() -> None:
    assert not _table_matches(lambda m: 4 if 1000 <= m < 1100 else 1 if m < 5000 else 2)


@pytest.mark.parametrize("kind", ["mla", "mla16"])
def test_the_gluon_launch_counter_sees_a_bound_call(
    stub: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``counting_gluon_launches`` counts a call whose shape class was bound before the block
    (the benchmark probes one kind, then the next, on the same case): without forgetting the
    validated calls, the second probe replayed the bound launch and counted nothing."""
    from kv_kernels.testing_attention import counting_gluon_launches

    args = _gluon_case(kind, monkeypatch)
    _run(args)  # binds the class
    _run(args)
    with counting_gluon_launches("decode") as decode:
        _run(args)
    with counting_gluon_launches("mla") as mla:
        _run(args)
    assert (len(decode), len(mla)) == (0, 1)
