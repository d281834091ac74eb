"""A bench record on the terminal, on disk (JSON) and as a plot (PNG).

The record (``runner.run``): provenance (command, commit, modified files, date,
device, versions), the model and shard, the method (replays, L2 flush, routing,
KV cache), the copy bandwidth, what the baseline and the executor are, the
collectives left out, and per (context, routing): distinct experts per layer,
the check, bytes and floor, each side's step median and min-max and its
fraction of the floor, the speedup, and every block's bytes, floor and times;
per context, the candidates' blocks (``--candidates``) and their times.

A record of every rank (``ranks.py``) has ``ranks`` (tp, backend, placement) and,
per (context, routing), each rank's step times with its collectives and detached,
each rank's bytes and floor, and no baseline (``ranks_table``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .clockwatch import pj_per_byte, reasons_text

KIND_ORDER = ("embed", "boundary", "attention (sliding)", "attention (full)", "attention_boundary", "moe", "final")


def _projections(shard: dict[str, Any]) -> str:
    """The record's pooler and unpooler cut where they are sharded (older records: replicated)."""
    return "pooler and unpooler column-sharded, " if shard.get("pooler_unpooler") == "column-sharded" else ""


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def by_kind(blocks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per block kind: count, bytes, floor and each side's median summed over layers."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "bytes": 0, "floor_s": 0.0})
    for entry in blocks.values():
        row = out[entry["kind"]]
        row["count"] += 1
        row["bytes"] += entry["bytes"]
        row["floor_s"] += entry["floor_s"]
        for side in ("baseline", "executor"):
            if side in entry:
                row[side] = row.get(side, 0.0) + entry[side]["median_s"]
    return {k: out[k] for k in KIND_ORDER if k in out}


def _span(t: dict[str, Any]) -> str:
    return f"{_us(t['median_s'])} [{_us(t['min_s'])}-{_us(t['max_s'])}]"


def _header(r: dict[str, Any]) -> list[str]:
    return [
        f"sparkdecode bench {r['config']}: {r['device']}, {r['mode']}, commit {r['commit'][:12]}"
        + (" (+ modified files)" if r.get("modified_files") else "")
        + f", {r['date']}",
    ]


def ranks_table(record: dict[str, Any]) -> str:
    """A record of every rank: the step (slowest rank) with its collectives, detached,
    their difference, the floor, and each rank's median."""
    r, ranks = record, record["ranks"]
    lines = _header(r)
    if not r["speed_claim"]:
        why = r.get("label") or ("eager on the CPU" if r["gpu"] is None else "a smoke run")
        lines.append(f"NOT A SPEED CLAIM ({why}): these times only show the bench runs.")
    m, s = r["model"], r["shard"]
    lines.append(
        f"model: {m['preset']} {m['layers']} layers (H {m['hidden_size']}, E {m['experts']} top-{m['top_k']}), "
        f"every rank of TP {s['tp']} ({s['expert_parallel']} experts), {s['expert_format']} experts, "
        f"{_projections(s)}{s['weights_bytes'] / 1e9:.2f} GB of layer weights a rank"
    )
    lines.append(f"ranks: {ranks['placement']}")
    bw = [b["bytes_per_s"] / 1e12 for b in r["copy_bandwidth_by_rank"]]
    lines.append(f"copy bandwidth by rank: {', '.join(f'{b:.3f}' for b in bw)} TB/s")
    lines.append(f"torch baseline: {r['baseline']['what']}")
    lines.append("executor layout: " + ", ".join(f"{k}={v}" for k, v in r["executor"]["layout"].items()))
    if r["executor"]["detached_layout"] != r["executor"]["layout"]:
        lines.append("detached layout: " + ", ".join(f"{k}={v}" for k, v in r["executor"]["detached_layout"].items()))
    if not r["executor"]["layout_identical_across_ranks"]:
        lines.append("executor: THE RANKS CHOSE DIFFERENT LAYOUTS")
    for c in r["collectives_timed"]:
        lines.append(f"in the time: {c}")
    lines.append(
        f"step: the slowest rank's median [min-max] of {r['replays']} "
        + ("replays, L2 flushed before each; " if r["gpu"] else "eager runs; ")
        + "detached: the same ranks without their collectives; coll = step - detached; "
        "floor = the largest rank's bytes / its copy bandwidth; % = floor / step"
    )
    head = (
        f"{'context':>7} {'routing':<10} {'experts/L':>9} {'GB/rank':>8} {'floor us':>9} | "
        f"{'step us [min-max]':<26} {'%':>5} | {'detached us':>11} {'coll us':>9} | {'by rank us':<30} {'check':<6}"
    )
    lines += [head, "-" * len(head)]
    for run in r["runs"]:
        e, d, c = run["executor"], run["detached"], run["check"]
        experts = sum(run["distinct_experts"]) / len(run["distinct_experts"])
        ok = c["finite"] and c["replicated_output_identical"] and c["routing_identical"]
        lines.append(
            f"{run['context']:>7} {run['routing']:<10} {experts:>9.1f} {max(run['bytes_by_rank']) / 1e9:>8.3f} "
            f"{_us(run['floor_s']):>9} | {_span(e):<26} "
            f"{100 * e['fraction_of_floor']:>4.1f}% | {_us(d['median_s']):>11} {_us(run['collectives_s']):>9} | "
            f"{' '.join(_us(t['median_s']) for t in e['by_rank']):<30} "
            + ("ok" if ok else "FAILED: " + ", ".join(k for k, v in c.items() if not v))
        )
    return "\n".join(lines)


def table(record: dict[str, Any]) -> str:
    if "ranks" in record:
        return ranks_table(record)
    r = record
    lines = _header(r)
    if not r["speed_claim"]:
        why = "eager on the CPU" if r["gpu"] is None else "the tiny config is a smoke run"
        lines.append(f"NOT A SPEED CLAIM ({why}): these times only show the bench runs.")
    m, s = r["model"], r["shard"]
    lines.append(
        f"model: {m['preset']} {m['layers']} layers (H {m['hidden_size']}, E {m['experts']} top-{m['top_k']}), "
        f"TP {s['tp']} rank {s['rank']}"
        + (f" ({s['expert_parallel']} experts)" if s["tp"] > 1 else "")
        + f", {s['expert_format']} experts, {_projections(s)}{s['weights_bytes'] / 1e9:.2f} GB of layer weights"
    )
    bw = r["copy_bandwidth"]
    lines.append(
        f"copy bandwidth: {bw['bytes_per_s'] / 1e12:.3f} TB/s ({bw['bytes_moved'] / 2**30:.0f} GiB read + written, "
        f"median of {bw['copies']} copies)"
    )
    lines.append(f"torch baseline: {r['baseline']['what']}")
    lines.append("executor layout: " + ", ".join(f"{k}={v}" for k, v in r["executor"]["layout"].items()))
    for note in r["executor"].get("notes", []):
        lines.append(f"executor: {note}")
    if r.get("max_context"):
        lines.append(f"executor: built for a max context of {r['max_context']} (as served), each context below it")
    for c in r["collectives_left_out"]:
        lines.append(f"left out of the time: {c}")
    lines.append(
        f"step times: median [min-max] of {r['replays']} "
        + ("replays, L2 flushed before each; " if r["gpu"] else "eager runs; ")
        + "floor = bytes / copy bandwidth; % = floor / median"
    )
    fewer = sorted({run["baseline"]["count"] for run in r["runs"] if run["baseline"]["count"] < r["replays"]})
    if fewer:
        lines.append(
            f"baseline: timed over {', '.join(map(str, fewer))} replays only (its step is slow); "
            f"the executor over {r['replays']}"
        )
    lines.append(
        "attn err: the baseline's attention block vs the reference on identical inputs (largest over layers); "
        "out err: the step's hidden states, baseline vs executor (amplified where an expert choice flips); "
        "routed: layers whose expert choices agree"
    )
    head = (
        f"{'context':>7} {'routing':<10} {'experts/L':>9} {'GB':>7} {'floor us':>9} | "
        f"{'baseline us [min-max]':<26} {'%':>5} | {'executor us [min-max]':<26} {'%':>5} | {'base/exec':>9} "
        f"{'attn err':>8} {'out err':>8} {'routed':>6}"
    )
    lines += [head, "-" * len(head)]
    for run in r["runs"]:
        b, e = run["baseline"], run["executor"]
        experts = sum(run["distinct_experts"]) / len(run["distinct_experts"])
        lines.append(
            f"{run['context']:>7} {run['routing']:<10} {experts:>9.1f} {run['bytes'] / 1e9:>7.3f} "
            f"{_us(run['floor_s']):>9} | {_span(b):<26} {100 * b['fraction_of_floor']:>4.1f}% | "
            f"{_span(e):<26} {100 * e['fraction_of_floor']:>4.1f}% | {run['speedup_baseline_over_executor']:>9.3f} "
            f"{run['check']['attention_relative_error']:>8.1e} {run['check']['relative_error_baseline_vs_executor']:>8.1e} "
            f"{run['check']['layers_routed_alike']:>3}/{len(run['distinct_experts']):<2}"
            + ("" if run["check"]["finite"] else "  NOT FINITE")
        )
    lines += clocks_lines(r["runs"])
    for run in r["runs"]:
        kinds = by_kind(run["blocks"])
        if not any("executor" in k for k in kinds.values()):
            continue
        lines.append("")
        lines.append(
            f"per block, context {run['context']}, {run['routing']} routing: each block alone in a graph, "
            f"median of {r['block_replays']}, summed over layers (orientation only)"
        )
        lines.append(f"  {'block':<20} {'n':>3} {'MB':>9} {'floor us':>9} {'baseline us':>12} {'executor us':>12}")
        for kind, row in kinds.items():
            lines.append(
                f"  {kind:<20} {row['count']:>3} {row['bytes'] / 1e6:>9.2f} {_us(row['floor_s']):>9} "
                f"{_us(row.get('baseline')):>12} {_us(row.get('executor')):>12}"
            )
    lines += candidates_table(record)
    return "\n".join(lines)


def clocks_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The GPU's clocks through each run's executor replays, where the run watched them."""
    lines = []
    for run in runs:
        c = run.get("clocks")
        if not c:
            continue
        where = f"clocks, context {run['context']} {run['routing']}"
        if not c["samples"]:
            lines.append(f"{where}: the executor's replays ended before a sample ({c['power_field']})")
            continue
        reasons = reasons_text(c["reasons"])
        rate = run["bytes"] / run["executor"]["median_s"]  # the step's bytes a second
        lines.append(
            f"{where}: SM {c['sm_mhz_median']:.0f} MHz (min {c['sm_mhz_min']:.0f}), memory {c['mem_mhz_median']:.0f} MHz, "
            f"{c['power_field']} {c['power_w_median']:.0f} W (max {c['power_w_max']:.0f} of {c['limit_w']:.0f}), "
            f"{pj_per_byte(c['power_w_median'], rate):.0f} pJ a byte of the floor, {c['temp_c_max']:.0f} C; "
            f"{c['samples']} samples: {reasons}"
        )
    return lines


def candidates_table(record: dict[str, Any]) -> list[str]:
    """Per context: each candidate provider's blocks alone in a graph, medians summed
    over the sliding and the full layers."""
    lines: list[str] = []
    types = record["model"]["layer_types"]
    for entry in record.get("candidates", []):
        sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for block, providers in entry["blocks"].items():
            kind, layer = block.rsplit(".", 1)
            column = "sliding" if types[int(layer)].startswith("sliding") else "full"
            for name, times in providers.items():
                sums[(kind, name)][column] += times["median_s"]
        lines.append("")
        lines.append(
            f"candidates, context {entry['context']}: each provider's block alone in a graph on random inputs, "
            f"median of {record['block_replays']}, summed over layers (orientation only)"
        )
        lines.append(f"  {'kind':<16} {'provider':<34} {'sliding us':>11} {'full us':>9} {'all us':>9}")
        for (kind, name), row in sums.items():
            lines.append(
                f"  {kind:<16} {name:<34} {_us(row.get('sliding')):>11} {_us(row.get('full')):>9} "
                f"{_us(sum(row.values())):>9}"
            )
    return lines


def stem(record: dict[str, Any]) -> str:
    date = record["date"].replace("-", "").replace(":", "").split("+")[0]
    return f"{record['config']}_{date}_{record['commit'][:9]}"


def write(record: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem(record)}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed where the plot was asked for."""


def plot(record: dict[str, Any], path: Path) -> Path:
    """A PNG: per (context, routing), each block kind's time (summed over layers;
    each block alone in a graph) beside its floor, baseline and executor; log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError(
            "matplotlib is not installed here: make the plot where it is, from the JSON record, with "
            "`sparkdecode bench --plot-from RECORD.json`"
        ) from e
    runs = [run for run in record["runs"] if any("executor" in b for b in run["blocks"].values())]
    if not runs:
        raise ValueError("the record has no per-block times (it was run with --no-blocks)")
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        kinds = by_kind(run["blocks"])
        names = list(kinds)
        xs = range(len(names))
        width = 0.27
        for offset, (label, key, color) in zip(
            (-width, 0.0, width),
            (
                ("floor", "floor_s", "0.6"),
                ("torch baseline", "baseline", "tab:blue"),
                ("executor", "executor", "tab:orange"),
            ),
        ):
            values = [kinds[n].get(key, 0.0) * 1e6 for n in names]
            ax.bar([x + offset for x in xs], values, width, label=label, color=color)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{n}\n(x{kinds[n]['count']})" for n in names], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("us (summed over layers)")
        b, e = run["baseline"]["median_s"] * 1e6, run["executor"]["median_s"] * 1e6
        ax.set_title(
            f"{record['config']}, context {run['context']}, {run['routing']} routing: step baseline {b:.0f} us, "
            f"executor {e:.0f} us, floor {run['floor_s'] * 1e6:.0f} us",
            fontsize=9,
        )
        ax.legend(fontsize=8)
    claim = "" if record["speed_claim"] else " (NOT A SPEED CLAIM)"
    fig.suptitle(f"{record['device']}, commit {record['commit'][:9]}, {record['date']}{claim}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
