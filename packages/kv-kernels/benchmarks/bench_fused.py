"""The fused elementwise ops on a CUDA GPU against the unfused torch sequences the engine runs
today, in the same process, at Llama-3-8B's shape (hidden 4096, 32 q / 8 kv heads of 128, MLP
14336, bf16): decode batches of 64 and 256 tokens and a prefill chunk of 8192.

Cases (``T`` tokens; ``b = 2`` bytes of bf16; every tensor counted once read, once written):

- ``add+rms_norm``: ``h = x + residual``, ``y = rms_norm(h) * w``:
  ``bytes = 4 * T * 4096 * b + 4096 * b`` (x, residual read; h, y written; the weight);
  unfused: ``residual.add_(x)`` then the engine's ``RMSNorm`` composite (float32 upcast, pow,
  mean, rsqrt, two multiplies, casts).
- ``silu_and_mul``: ``[T, 2 * 14336] -> [T, 14336]``: ``bytes = 3 * T * 14336 * b``;
  unfused: ``silu(gate).mul_(up)``.
- ``rope``: q ``[T, 32, 128]`` and k ``[T, 8, 128]`` rotated in place as slices of the qkv
  projection's output: ``bytes = 2 * T * 40 * 128 * b + T * 128 * 4`` (q, k read and written;
  one float32 cos/sin row per token); unfused: the engine's ``RotaryEmbedding`` (cos/sin from the
  positions, ``x * cos + cat(x2, x1) * sin`` for q and for k, copied back into the qkv buffer).
- ``rope+cache``: rope on q and k, then k and v into a bf16 LBNHC cache (block 16, shuffled
  slots): ``bytes = T * (2 * 40 + 2 * 8) * 128 * b + T * 128 * 4 + T * 8`` (q, k read and
  written, k and v written to the cache, v read, the cos/sin row and the slot); fused
  ``rope_and_cache`` against ``rotary_embedding`` + ``reshape_and_cache`` (two Triton launches,
  the baseline) and against the unfused torch rope + ``reshape_and_cache``.
- ``layer``: one decoder layer's elementwise work (two add+norms, rope, silu_and_mul) as the four
  fused calls against the unfused sequence: what a decode step pays per layer outside the GEMMs
  and attention (issue 32's profile: ~0.4 ms a step of unfused kernels at 8 layers).

Each record: ``ms`` (GPU time from a CUDA-graph replay, ``_timing.gpu_ms``), ``TB/s`` of the
bytes above, ``of_copy`` (against a device-to-device copy measured in this process), the
unfused baseline's figures beside, ``eager_ms`` and ``host_ms`` (the host's enqueue time of one
call: what the fused op saves in launches shows here and in eager mixed steps). No claim is made
until the numbers are run on a GPU::

    PYTHONPATH=packages/kv-spec/src:packages/kv-kernels/src python3 \\
        packages/kv-kernels/benchmarks/bench_fused.py --out /tmp/bench

``--smoke`` runs tiny shapes under the Triton interpreter on the CPU (checks the script, its
parity asserts and its records; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

if {"--smoke", "--quick"} & set(sys.argv):
    # before the first import of the Triton kernels: the interpreter decides at definition time
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _records import BandwidthRecorder  # this folder's shared record writer
from kv_kernels import allocate_kv_cache, layer_view, reshape_and_cache
from kv_kernels.fused import (
    rms_norm,
    rope_and_cache,
    rope_cos_sin_cache,
    rotary_embedding,
    silu_and_mul,
)
from kv_spec import KVCacheLayout, LayoutOrder

HIDDEN, HQ, HK, HEAD, MLP = 4096, 32, 8, 128, 14336
SMOKE_SHAPE = {"HIDDEN": 64, "HQ": 4, "HK": 2, "HEAD": 16, "MLP": 96}
EPS = 1e-5


def _timer(device: str) -> Callable[[Callable[[], Any]], dict[str, Any]]:
    if device == "cuda":
        from _timing import timed

        return lambda fn: timed(fn)

    def cpu(fn: Callable[[], Any]) -> dict[str, Any]:
        fn()
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return {"ms": ms, "timing": "cpu-wall", "eager_ms": ms, "host_ms": ms}

    return cpu


def _copy_tbps(device: str) -> float:
    if device != "cuda":
        return float("nan")
    from _timing import copy_limit

    return copy_limit(device)


# ---- the unfused sequences (the engine's layers.py today, written out) -----------------------------


def unfused_add_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    residual.add_(x)
    h = residual.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return h.to(x.dtype).mul_(w)


def unfused_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class UnfusedRope:
    """The engine's RotaryEmbedding: cos/sin ``[T, 1, D]`` from the positions each call, then
    ``x * cos + cat(x2, x1) * sin`` per tensor, written back into the qkv buffer."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> None:
        half = inv_freq.numel()
        self.head_freq = inv_freq.repeat(2)
        self.sin_scale = torch.ones(2 * half, device=inv_freq.device)
        self.sin_scale[:half] = -1
        self.dtype = dtype

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        freqs = positions.float()[:, None] * self.head_freq
        cos = freqs.cos().to(self.dtype)[:, None, :]
        sin = (freqs.sin() * self.sin_scale).to(self.dtype)[:, None, :]
        for x in (q, k):
            x1, x2 = x.chunk(2, dim=-1)
            out = x * cos
            x.copy_(out.add_(torch.cat([x2, x1], dim=-1).mul_(sin)))


# ---- cases -----------------------------------------------------------------------------------------


def run(device: str, smoke: bool, out_dir: str) -> None:
    shape = (
        SMOKE_SHAPE if smoke else {"HIDDEN": HIDDEN, "HQ": HQ, "HK": HK, "HEAD": HEAD, "MLP": MLP}
    )
    hidden, hq, hk, head, mlp = (shape[k] for k in ("HIDDEN", "HQ", "HK", "HEAD", "MLP"))
    dtype = torch.float16 if smoke else torch.bfloat16  # (the interpreter's bf16 is wrong)
    timed = _timer(device)
    copy = _copy_tbps(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    record = BandwidthRecorder("fused_ops", name)
    print(json.dumps({"copy": "torch copy_", "TB/s": copy, "device": name}), flush=True)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head, 2, device=device).float() / head)
    cache = rope_cos_sin_cache(inv_freq, 8192 if not smoke else 64)
    unfused_rope = UnfusedRope(inv_freq, dtype)
    g = torch.Generator(device=device).manual_seed(0)

    for tokens in (64, 256, 8192) if not smoke else (3, 5):
        _bench_tokens(
            tokens, (hidden, hq, hk, head, mlp), dtype, device, cache, unfused_rope, g, record,
            timed, copy,
        )  # fmt: skip
    record.write(out_dir)


def _bench_tokens(
    tokens: int, dims: tuple[int, int, int, int, int], dtype: torch.dtype, device: str,
    cache: torch.Tensor, unfused_rope: UnfusedRope, g: torch.Generator,
    record: BandwidthRecorder, timed: Callable[[Callable[[], Any]], dict[str, Any]], copy: float,
) -> None:  # fmt: skip
    """Every case at ``tokens`` tokens: parity against the unfused sequence, then timings."""
    hidden, hq, hk, head, mlp = dims
    b = torch.tensor([], dtype=dtype).element_size()

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g, device=device).to(dtype)

    x, res, w = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    gate_up = rand(tokens, 2 * mlp)
    qkv = rand(tokens, (hq + 2 * hk) * head)
    positions = torch.randint(0, cache.shape[0], (tokens,), generator=g, device=device)
    q = qkv[:, : hq * head].view(tokens, hq, head)
    k = qkv[:, hq * head : (hq + hk) * head].view(tokens, hk, head)

    # parity first: a benchmark of a wrong kernel is worthless
    y_f, _ = rms_norm(x, w, EPS, residual=res.clone())
    y_u = unfused_add_norm(x, res.clone(), w)
    torch.testing.assert_close(y_f, y_u, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(
        silu_and_mul(gate_up), unfused_silu_and_mul(gate_up), rtol=2e-2, atol=2e-2
    )
    q1, k1 = q.clone(), k.clone()
    rotary_embedding(positions, q1, k1, cache)
    q2, k2 = q.clone(), k.clone()
    unfused_rope(positions, q2, k2)
    torch.testing.assert_close(q1, q2, rtol=2e-2, atol=5e-2)

    h_out = torch.empty_like(x)
    y_out = torch.empty_like(x)
    act_out = torch.empty(tokens, mlp, dtype=dtype, device=device)
    cases: dict[str, tuple[int, Callable[[], Any], Callable[[], Any]]] = {
        "add+rms_norm": (
            4 * tokens * hidden * b + hidden * b,
            lambda: rms_norm(x, w, EPS, residual=res, out=y_out, residual_out=h_out),
            lambda: unfused_add_norm(x, res, w),
        ),
        "silu_and_mul": (
            3 * tokens * mlp * b,
            lambda: silu_and_mul(gate_up, out=act_out),
            lambda: unfused_silu_and_mul(gate_up),
        ),
        "rope": (
            2 * tokens * (hq + hk) * head * b + tokens * head * 4,
            lambda: rotary_embedding(positions, q, k, cache),
            lambda: unfused_rope(positions, q, k),
        ),
    }

    def fused_layer() -> None:
        rms_norm(x, w, EPS, residual=res, out=y_out, residual_out=h_out)
        rotary_embedding(positions, q, k, cache)
        rms_norm(x, w, EPS, residual=res, out=y_out, residual_out=h_out)
        silu_and_mul(gate_up, out=act_out)

    def unfused_layer() -> None:
        unfused_add_norm(x, res, w)
        unfused_rope(positions, q, k)
        unfused_add_norm(x, res, w)
        unfused_silu_and_mul(gate_up)

    # the cache write: k and v of this step into shuffled slots of a cache twice the batch's size
    block = 16
    num_blocks = 2 * (tokens + block - 1) // block + 2
    layout = KVCacheLayout(
        order=LayoutOrder.LBNHC, num_layers=1, num_blocks=num_blocks, num_kv_heads=hk, block_size=block,
        head_size=head, head_size_v=head, dtype="float16" if dtype == torch.float16 else "bfloat16",
    )  # fmt: skip
    kv_view = layer_view(allocate_kv_cache(layout, device), layout, 0)
    slots = torch.randperm(num_blocks * block, generator=g, device=device)[:tokens]
    v = qkv[:, (hq + hk) * head :].view(tokens, hk, head)
    rc_bytes = tokens * (2 * (hq + hk) + 2 * hk) * head * b + tokens * head * 4 + tokens * 8

    q_a, k_a, q_b, k_b = q.clone(), k.clone(), q.clone(), k.clone()
    rotary_embedding(positions, q_a, k_a, cache)
    reshape_and_cache(k_a, v, kv_view, slots, layout)
    written = kv_view.clone()
    rope_and_cache(positions, q_b, k_b, v, cache, kv_view, slots, layout)
    torch.testing.assert_close(kv_view, written, rtol=0, atol=2e-2)  # (FMA contraction may differ)
    torch.testing.assert_close(q_b, q_a, rtol=0, atol=2e-2)

    def rope_then_write() -> None:
        rotary_embedding(positions, q, k, cache)
        reshape_and_cache(k, v, kv_view, slots, layout)

    def torch_rope_then_write() -> None:
        unfused_rope(positions, q, k)
        reshape_and_cache(k, v, kv_view, slots, layout)

    def fused_write() -> None:
        rope_and_cache(positions, q, k, v, cache, kv_view, slots, layout)

    label = f"rope+cache T={tokens}"
    pair = timed(rope_then_write)
    record(label, "rotary_embedding + reshape_and_cache", pair["ms"], rc_bytes, None, None,
           timing=pair["timing"], eager_ms=pair["eager_ms"], host_ms=pair["host_ms"],
           of_copy=rc_bytes / pair["ms"] / 1e9 / copy)  # fmt: skip
    base = timed(torch_rope_then_write)
    record(label, "torch rope + reshape_and_cache", base["ms"], rc_bytes, None, None,
           timing=base["timing"], eager_ms=base["eager_ms"], host_ms=base["host_ms"],
           of_copy=rc_bytes / base["ms"] / 1e9 / copy)  # fmt: skip
    t = timed(fused_write)
    record(label, "triton rope_and_cache", t["ms"], rc_bytes,
           "rotary_embedding + reshape_and_cache", pair["ms"], timing=t["timing"],
           eager_ms=t["eager_ms"], host_ms=t["host_ms"], of_copy=rc_bytes / t["ms"] / 1e9 / copy)  # fmt: skip

    layer_bytes = 2 * cases["add+rms_norm"][0] + cases["rope"][0] + cases["silu_and_mul"][0]
    cases["layer"] = (layer_bytes, fused_layer, unfused_layer)
    for case, (nbytes, fused, unfused) in cases.items():
        label = f"{case} T={tokens}"
        base = timed(unfused)
        record(label, "torch unfused", base["ms"], nbytes, None, None,
               timing=base["timing"], eager_ms=base["eager_ms"], host_ms=base["host_ms"],
               of_copy=nbytes / base["ms"] / 1e9 / copy)  # fmt: skip
        t = timed(fused)
        record(label, "triton fused", t["ms"], nbytes, "torch unfused", base["ms"],
               timing=t["timing"], eager_ms=t["eager_ms"], host_ms=t["host_ms"],
               of_copy=nbytes / t["ms"] / 1e9 / copy)  # fmt: skip
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for fused_ops.json")
    ap.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes, interpreter, CPU")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_fused.py needs a CUDA GPU (or --smoke for the CPU check)")
    run("cpu" if args.smoke else "cuda", args.smoke, args.out)


if __name__ == "__main__":
    main()
