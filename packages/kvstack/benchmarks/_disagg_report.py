"""``bench_disagg.py``'s report beside its JSON: a table per request with the medians and the
goal's figure (``.md``), and each request's time to first token by mode (``.png``).

    python packages/kvstack/benchmarks/_disagg_report.py docs/benchmarks/disagg_p2p_h200x2.json

re-renders both from a written record (what ``docs/benchmarks`` commits beside the JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _plotting import pyplot

__all__ = ["render", "write_report"]

#: issue 30's goal: layer-wise streaming adds at most this share to the colocated TTFT
GOAL = 0.10


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def _over(v: float | None, base: float) -> str:
    return "—" if v is None else f"{v * 1e3:.1f} ({v / base - 1:+.0%})"


def _at(v: int | None) -> str:
    return "—" if v is None else str(v)


def _flag(v: object) -> str:
    return {True: "yes", False: "NO", None: "—"}.get(v, str(v))  # type: ignore[call-overload]


def render(record: dict[str, Any]) -> str:
    """The markdown report of one ``bench_disagg`` record."""
    cfg, med, rows = record["config"], record["median"], record["per_request"]
    layerwise = "layerwise_ttft_at_decode_s" in med
    lines = [
        f"# Disaggregated prefill over {cfg['transport']} on {record['device_name']}",
        "",
        f"Written by `packages/kvstack/benchmarks/bench_disagg.py`: prefill on "
        f"{record['devices']['prefill']}, decode on {record['devices']['decode']}; "
        f"{cfg['requests']} prompts of {cfg['prompt_tokens']} tokens, a random "
        f"{cfg['layers']}-layer model of width {cfg['hidden']} ({cfg['heads']} heads), "
        f"{cfg['decode_tokens']} new tokens each. torch {record.get('torch')}, commit "
        f"{record.get('git_commit')}, source_sha1 {record.get('source_sha1')}.",
        "",
        "Time to first token (ms): colocated = one engine on the decode GPU; whole-request = "
        "the prefill engine computes the prompt, the decode engine pulls its KV, then decodes; "
        "layer-wise = the decode engine loads each layer while the prefill engine computes the "
        "next. Both disaggregated times run from the prefill process reading the prompt to the "
        "decode engine's first token; in brackets, against the colocated TTFT. KV equal: the "
        "loaded blocks' digest equals the producer's. First divergence: the first token that "
        "differs from the colocated run (— : none).",
        "",
        "| request | colocated | whole-request | layer-wise | transfer | KV equal (whole / "
        "layer-wise) | first divergence (whole / layer-wise) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        base = r["colocated_ttft_s"]
        lines.append(
            f"| {i} | {_ms(base)} | {_over(r['ttft_at_decode_s'], base)} | "
            f"{_over(r.get('layerwise_ttft_at_decode_s'), base)} | {_ms(r['transfer_s'])} | "
            f"{_flag(r['kv_equal'])} / {_flag(r.get('layerwise_kv_equal'))} | "
            f"{_at(r.get('first_divergence'))} / {_at(r.get('layerwise_first_divergence'))} |"
        )
    base = med["colocated_ttft_s"]
    lines += [
        f"| median | {_ms(base)} | {_over(med['ttft_at_decode_s'], base)} | "
        f"{_over(med.get('layerwise_ttft_at_decode_s'), base)} | {_ms(med['transfer_s'])} | | |",
        "",
    ]
    if layerwise:
        share = med["layerwise_ttft_at_decode_s"] / base - 1
        verdict = "met" if share <= GOAL else "not met"
        lines.append(
            f"- Layer-wise streaming adds {share:+.1%} to the colocated time to first token "
            f"(medians; goal <= {GOAL:.0%}: {verdict})."
        )
    lines += [
        f"- Loaded KV equal to the producer's in all {record['kv_checks']} checks: "
        f"{_flag(record['all_kv_equal'])}; load failures: {record.get('load_failures')}.",
        f"- Decode tokens/s (median): colocated {med['colocated_decode_tok_s']:.0f}, "
        f"whole-request {med['disagg_decode_tok_s']:.0f}"
        + (f", layer-wise {med['layerwise_decode_tok_s']:.0f}" if layerwise else "")
        + ".",
        "",
    ]
    return "\n".join(lines)


def _plot(record: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = record["per_request"]
    modes = [("colocated", "colocated_ttft_s"), ("whole-request", "ttft_at_decode_s")]
    if "layerwise_ttft_at_decode_s" in rows[0]:
        modes.append(("layer-wise", "layerwise_ttft_at_decode_s"))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(modes)
    for k, (label, key) in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r[key] * 1e3 for r in rows], width, label=label)
    base = record["median"]["colocated_ttft_s"] * 1e3
    ax.axhline(base * (1 + GOAL), ls=":", c="k", lw=0.8, label=f"colocated median +{GOAL:.0%}")
    ax.set_xticks(range(len(rows)), [f"request {i}" for i in range(len(rows))])
    ax.set_ylabel("time to first token (ms)")
    cfg = record["config"]
    ax.set_title(f"{cfg['prompt_tokens']}-token prompts, {record['device_name']}", fontsize=10)
    top = max(r[key] for r in rows for _label, key in modes) * 1e3
    ax.set_ylim(0, top * 1.3)  # (room above the bars for the legend)
    ax.legend(fontsize=8, loc="upper center", ncol=len(modes) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(record: dict[str, Any], json_path: Path) -> list[Path]:
    """``json_path``'s ``.md`` (and ``.png`` where matplotlib is installed); the paths written."""
    md = json_path.with_suffix(".md")
    md.write_text(render(record))
    png = json_path.with_suffix(".png")
    return [md, png] if _plot(record, png) else [md]


def main() -> None:
    ap = argparse.ArgumentParser(description="re-render bench_disagg records' .md and .png")
    ap.add_argument("files", type=Path, nargs="+")
    for path in ap.parse_args().files:
        for out in write_report(json.loads(path.read_text()), path):
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
