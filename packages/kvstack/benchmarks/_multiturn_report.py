"""``bench_multiturn.py``'s report beside its JSON: time to first token by turn for each mode with
the history each turn resent, the goal's verdict (``.md``), and TTFT against the history's length
(``.png``).

    python packages/kvstack/benchmarks/_multiturn_report.py docs/benchmarks/multiturn_cuda.json

re-renders both from a written record (what ``docs/benchmarks`` commits beside the JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from _plotting import pyplot

__all__ = ["render", "write_report"]


def _turns(r: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(turn, median history tokens, median TTFT s) of one mode's results."""
    return [
        (
            int(t),
            statistics.median(r["history_tokens_by_turn"][t]),
            statistics.median(v),
        )
        for t, v in sorted(r["ttft_s_by_turn"].items(), key=lambda kv: int(kv[0]))
    ]


def render(record: dict[str, Any]) -> str:
    """The markdown report of one ``bench_multiturn`` record."""
    cfg, res = record["config"], record["results"]
    modes = list(res)
    model = cfg.get("model", {})
    lines = [
        f"# Multi-turn conversations with and without a CPU tier on {record['device']}",
        "",
        f"Written by `packages/kvstack/benchmarks/bench_multiturn.py`: {cfg['conversations']} "
        f"conversations x {cfg['turns']} turns, round robin, one request at a time; each turn "
        f"resends the history plus {cfg['user_tokens']} new tokens and generates "
        f"{cfg['reply_tokens']}. Model: {cfg.get('shape') or 'a small Llama'} "
        f"({model.get('num_hidden_layers', cfg.get('layers'))} layers, width "
        f"{model.get('hidden_size', cfg.get('hidden'))}), random weights, {cfg['dtype']}; a pool "
        f"of {cfg['pool_blocks']} blocks of {cfg['block_size']} tokens (the histories outgrow "
        f"it), a CPU tier of {cfg['tier_bytes'] / 2**30:.2f} GiB. torch {record.get('torch')}, "
        f"commit {record.get('git_commit')}, source_sha1 {record.get('source_sha1')}.",
        "",
        "Time to first token (ms, median over the conversations): from `add_request` to the "
        "first token, the history's loads included; history = the tokens resent before the new "
        "ones (what a tier can serve). gpu_prefix_cache: a pool that keeps every history (each "
        "turn a GPU prefix-cache hit: the floor a tier approaches, and the reference a tier's "
        "replies must equal token for token; recomputing a history in one prefill, no_tier may "
        "round its KV differently from the decode steps that wrote it).",
        "",
        "| turn | history tokens | " + " | ".join(modes) + " | "
        + " | ".join(f"{m} / no_tier" for m in modes[1:]) + " |",
        "|" + "---|" * (2 + len(modes) + len(modes) - 1),
    ]  # fmt: skip
    per_mode = {m: _turns(res[m]) for m in modes}
    for i, (turn, hist, base) in enumerate(per_mode["no_tier"]):
        cells = [f"{per_mode[m][i][2] * 1e3:.1f}" for m in modes]
        ratios = [f"{per_mode[m][i][2] / base:.2f}" for m in modes[1:]]
        lines.append(f"| {turn} | {hist:.0f} | " + " | ".join(cells + ratios) + " |")
    lines.append("")
    lines += _queued(res, modes)
    for m in modes:
        r = res[m]
        lines.append(
            f"- {m}: {r['tokens_per_s']:.1f} tokens/s over the run ({r['wall_s']:.1f} s); prompt "
            f"tokens computed {r['prompt_tokens_computed']}, served by the pool's prefix cache "
            f"{r['pool_hit_tokens']}, loaded from the tier {r['tier_loaded_tokens']}"
            + (
                f"; load failures {r['tier_load_failures']}" + _connector_host(r)
                if "replies_equal_gpu_prefix_cache" in r  # (a tier's run)
                else ""
            )
            + "".join(
                f"; replies equal to {ref}'s: {'yes' if r[key] else 'no'}"
                for ref in ("gpu_prefix_cache", "no_tier")
                if (key := f"replies_equal_{ref}") in r
            )
            + "."
        )
        goal = r.get("goal")
        if goal is None:
            continue
        if goal["ratio"] is None:
            lines.append(f"  - No turn resent {goal['prefix_tokens']} tokens or more: no verdict.")
            continue
        lines.append(
            f"  - Goal (a hit on a prefix of >= {goal['prefix_tokens']} tokens: TTFT <= "
            f"{goal['goal_ratio']:.2f} of recomputing it): {goal['ttft_s'] * 1e3:.1f} vs "
            f"{goal['no_tier_ttft_s'] * 1e3:.1f} ms over {goal['turns']} turns = "
            f"{goal['ratio']:.2f}, {'met' if goal['met'] else 'not met'}."
        )
    lines.append("")
    return "\n".join(lines)


def _plot(record: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for mode, r in record["results"].items():
        pts = _turns(r)
        ax.plot([p[1] for p in pts], [p[2] * 1e3 for p in pts], marker="o", label=mode)
    ax.set_xlabel("history resent (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"multi-turn TTFT, {record['device']}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(json_path: Path) -> list[str]:
    """``json_path``'s ``.md`` (and ``.png`` where matplotlib is installed); the names written."""
    record = json.loads(json_path.read_text())
    md = json_path.with_suffix(".md")
    md.write_text(render(record))
    png = json_path.with_suffix(".png")
    return [md.name, png.name] if _plot(record, png) else [md.name]


def main() -> None:
    ap = argparse.ArgumentParser(description="re-render bench_multiturn records' .md and .png")
    ap.add_argument("files", type=Path, nargs="+")
    for path in ap.parse_args().files:
        print(path, "->", ", ".join(write_report(path)))


def _connector_host(r: dict[str, Any]) -> str:
    """The connector's worker-side host time a request (records from before it was kept have
    none: nothing is said)."""
    if "connector_load_host_s" not in r:
        return ""
    n = max(1, r["requests"])
    return (
        f"; connector host time a request {r['connector_load_host_s'] / n * 1e3:.1f} ms "
        f"loading, {r['connector_save_host_s'] / n * 1e3:.1f} ms saving"
    )


def _queued(res: dict[str, Any], modes: list[str]) -> list[str]:
    """The table of each turn's median time in the queue (``Completion.metrics``: from
    ``add_request`` to the step that first scheduled it, part of its TTFT); none for records
    from before it was kept."""
    if not all("queued_s_by_turn" in res[m] for m in modes):
        return []
    turns = sorted(res[modes[0]]["queued_s_by_turn"], key=int)
    lines = [
        "Of that, time in the queue (ms, median): from `add_request` to the step that first "
        "scheduled the request (waiting for blocks, e.g. ones a tier's save still holds).",
        "",
        "| turn | " + " | ".join(modes) + " |",
        "|" + "---|" * (1 + len(modes)),
    ]
    for t in turns:
        cells = [f"{statistics.median(res[m]['queued_s_by_turn'][t]) * 1e3:.1f}" for m in modes]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return [*lines, ""]


if __name__ == "__main__":
    main()
