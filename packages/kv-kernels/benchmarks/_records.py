"""Benchmark records shared by the bandwidth benchmarks (imported from the script's own folder).

One record per measurement, in the schema ``tools/render_benchmarks.py`` renders::

    {"bench", "case", "impl", "ms", "metric", "value", "baseline", "baseline_value", "ratio", "device"}
"""

from __future__ import annotations

import json
import os
from typing import Any

from _provenance import provenance  # this folder's copy

__all__ = ["BandwidthRecorder"]


def _versions() -> dict[str, str | bool | None]:
    """Where every record's numbers came from: Python, the workspace packages' and torch /
    triton versions as installed, the git commit and whether the tree was dirty."""
    return provenance("torch", "triton")


class BandwidthRecorder:
    """Collects TB/s records of one benchmark; ``bytes / ms / 1e9`` is TB/s."""

    def __init__(self, bench: str, device: str) -> None:
        self.bench = bench
        self.device = device
        self.records: list[dict[str, Any]] = []

    def __call__(
        self,
        case: str,
        impl: str,
        ms: float,
        nbytes: int,
        baseline: str | None,
        base_ms: float | None,
        **extra: Any,
    ) -> None:
        """One record; ``extra`` fields (e.g. ``host_ms``, ``eager_ms``, ``timing``) are kept."""
        value = nbytes / ms / 1e9
        base_value = nbytes / base_ms / 1e9 if base_ms else None
        rec = {
            "bench": self.bench,
            "case": case,
            "impl": impl,
            "ms": ms,
            "metric": "TB/s",
            "value": value,
            "baseline": baseline,
            "baseline_value": base_value,
            "ratio": (value / base_value) if base_value else None,
            "device": self.device,
            **_versions(),
            **extra,
        }
        self.records.append(rec)
        print(json.dumps(rec), flush=True)

    def write(self, out_dir: str) -> None:
        """``out_dir/<bench>.json`` and a markdown table on stdout."""
        with open(os.path.join(out_dir, f"{self.bench}.json"), "w") as f:
            json.dump(self.records, f, indent=1)
        print("\n| case | impl | ms | TB/s | vs | ratio |\n|---|---|---|---|---|---|")
        for r in self.records:
            ratio = "—" if r["ratio"] is None else f"{r['ratio']:.2f}"
            print(
                f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['value']:.4g} | {r['baseline'] or ''} | {ratio} |"
            )
