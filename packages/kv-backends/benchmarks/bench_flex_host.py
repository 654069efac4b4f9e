"""FLEX_ATTENTION's host path per ``forward`` on the CPU: the backend's own Python and eager ops
around its Flex calls, with Flex replaced by a stub that returns an output of the right shape.

The GPU record (``bench_flex.py``'s ``host ms``) is this plus the compiled calls' own host cost
(Dynamo's guards, the AOT wrapper, the inductor launches), which the backend cannot cut beyond
calling fewer of them. The cases are ``bench_flex.py``'s at its ``--smoke`` sizes (the same
branches: gathered prefill at page 16, paged prefill at page 128, the decode call, padded
static shapes) with small heads (:data:`HEADS`), built by its ``_batch``; the impl runs its compiled branch
(static shapes, ``dynamic=False``) with ``compiled_flex`` patched to the stub. Each record:
median (and least) microseconds a forward over ``--rounds`` blocks of ``--calls`` calls, and
the builder's microseconds a step beside it.

Usage (any machine)::

    python packages/kv-backends/benchmarks/bench_flex_host.py [--only mixed] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import bench_flex
import torch
from bench_flex import _batch, _cases

#: Heads of the host cases: the forward's Python and op count do not depend on them, and small
#: tensors keep the CPU's own memory work (copies, fills) out of the host figure.
HEADS = (4, 2, 16)  # q heads, kv heads, head size


def flex_stub(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Any = None,
    block_mask: Any = None,
    scale: Any = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Any = None,
) -> Any:
    """Flex's signature, no math: an output ``[B, Hq, L, Dv]`` laid out in the query's stride
    order (as Flex lays it out), and a log-sum-exp when asked."""
    b, hq, length, d = query.shape
    dv = value.shape[-1]
    if dv == d:  # (empty_like keeps q's dense stride order)
        out = torch.empty_like(query)
    else:
        out = torch.empty_strided(
            (b, hq, length, dv), _stride_like(query, dv), dtype=query.dtype, device=query.device
        )
    if return_lse:
        return out, torch.zeros(b, hq, length, dtype=torch.float32, device=query.device)
    return out


def _stride_like(q: torch.Tensor, dv: int) -> tuple[int, ...]:
    """Dense strides of ``[B, Hq, L, Dv]`` in ``q``'s stride order."""
    shape = [*q.shape[:-1], dv]
    strides = [0] * 4
    step = 1
    for i in sorted(range(4), key=q.stride):  # innermost first
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


def _time_forward(impl: Any, b: Any, md: Any, calls: int, rounds: int) -> list[float]:
    """Microseconds a forward, one value per block of ``calls`` calls."""
    impl.forward(None, b.q, b.kv_cache, md)
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            impl.forward(None, b.q, b.kv_cache, md)
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return per


def measure(case_filter: list[str], calls: int, rounds: int) -> list[dict[str, Any]]:
    from kv_backends import get_backend
    from kv_backends.backends.flex import impl as flex_impl

    real = flex_impl.compiled_flex
    flex_impl.compiled_flex = lambda static=False: flex_stub  # type: ignore[assignment]
    bench_flex.HQ, bench_flex.H, bench_flex.D = HEADS
    records = []
    try:
        for c in _cases(smoke=True):
            if case_filter and not any(t in c.name for t in case_filter):
                continue
            b = _batch(c, "cpu")
            backend = get_backend("FLEX_ATTENTION")
            for label, opts in (("FLEX_ATTENTION", {}), ("prefill=gather", {"prefill": "gather"})):
                if c.kind == "decode" and opts:
                    continue
                builder = backend.make_builder(
                    b.config,
                    b.layout,
                    device=torch.device("cpu"),
                    max_num_batched_tokens=max(sum(c.query_lens), 16),
                    max_num_seqs=len(c.query_lens),
                    static_shapes=True,
                    **opts,
                )
                md = builder.build(b.common)
                impl = backend.make_impl(b.config, b.layout, compiled=True)
                per = _time_forward(impl, b, md, calls, rounds)
                t0 = time.perf_counter()
                for _ in range(20):
                    builder.build(b.common)
                build_us = (time.perf_counter() - t0) / 20 * 1e6
                rec = {
                    "case": c.name,
                    "impl": label,
                    "forward_host_us": statistics.median(per),
                    # the least-disturbed block: steadier than the median on a shared machine
                    "forward_host_us_min": min(per),
                    "build_us": build_us,
                    "windows": len(md.windows),
                    "decode_call": md.decode is not None,
                }
                print(json.dumps(rec), flush=True)
                records.append(rec)
    finally:
        flex_impl.compiled_flex = real
    return records


def _keep_freed_memory() -> None:
    """glibc: serve large CPU allocations from the heap and keep freed memory, as the CUDA
    caching allocator does on the GPU; otherwise each output of a few MiB is a fresh mmap whose
    first touch page-faults (ms per forward here, none of it the backend's host work)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="cases whose name has this")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--json", default=None, help="also write the records here")
    args = p.parse_args(argv)
    # One thread: the eager ops here are tiny, and a parallel region on a busy machine waits
    # for its workers (ms per op on a shared 2-core CI box).
    torch.set_num_threads(1)
    _keep_freed_memory()
    records = measure(args.only, args.calls, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": "cpu", "torch": torch.__version__, "records": records}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
