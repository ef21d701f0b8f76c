"""BENCHMARKS.md and its plots from a results document (``SuiteResult.to_dict()``, or the JSON
bench_all wrote); and --compare against an older JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .breakdown import explain
from .suite import PAPER


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return ""
    if abs(x) >= 1000:
        s = f"{x:,.0f}"
    elif abs(x) >= 10:
        s = f"{x:.1f}"
    else:
        s = f"{x:.3g}"
    return f"{s} {unit}".strip()


def _met(m: dict[str, Any]) -> str:
    return {True: "yes", False: "**no**", None: ""}[m["met"]]


def write_report(doc: dict[str, Any], path: Path, plots_dir: Path, *, json_name: str) -> Path:
    plots = make_plots(doc, plots_dir)
    m = doc["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `python tools/bench_all.py{' --quick' if doc['mode'] == 'quick' else ''}` "
        f"(this report written at commit `{m['commit']}`); every figure below comes from a tool run "
        + ("in that same invocation" if not doc.get("reused") else
           "in that same invocation or, where the runs below say so, from an earlier run's results file "
           "(measured at an earlier commit, with the time it was written)")
        + f", whose command is given with it. Raw results: [`{json_name}`]({json_name}).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, Python {m['python']}, "
        f"torch {m['torch']}, accelerator: {m['accelerator']}. Ratios compare figures measured side by side "
        "in the same run; absolute times on this small, shared machine are noisy.",
        "",
        "## Headline",
        "",
        "| measure | ours | baseline (same run) | ratio | paper | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    measures = list(doc["measures"].values())
    for x in measures:
        # a baseline that could not run shows its label ("missing: nginx not installed")
        base = f"{_fmt(x['baseline'], x['unit'])} ({x['baseline_label']})" if x["baseline"] is not None else \
            x["baseline_label"]
        ratio = f"{x['ratio']:.2f}x" if x["ratio"] is not None else ""
        lines.append(f"| {x['title']} | {_fmt(x['ours'], x['unit'])} | {base} | {ratio} | {x['paper']} | "
                     f"{x['target']} | {_met(x)} |")
    lines += ["", f"Paper figures are from {PAPER}; targets are the project's own goals for each figure.", ""]
    unmet = [x for x in measures if x["met"] is False]
    lines += ["## Targets not met", ""]
    if not unmet:
        lines.append("Every measure with a target met it in this run.")
    for x in unmet:
        lines.append(f"- **{x['title']}**: {_fmt(x['ours'], x['unit'])}"
                     f"{' (' + format(x['ratio'], '.2f') + 'x)' if x['ratio'] is not None else ''}, "
                     f"target {x['target']}.")
    explained = explain(doc)
    if explained:
        lines += ["", "## Where the time goes", "",
                  "Measured parts of the slow paths, each timed alone on the same rows in the same run:", "",
                  *explained]
    lines += profile_lines(doc["profiles"])
    lines += ["", "## Commands and sizes", ""]
    for name, run in doc["runs"].items():
        sizes = sorted({x["sizes"] for x in measures if x["command"] == run["command"] and x["sizes"]})
        detail = f": {'; '.join(sizes)}" if sizes else ""
        lines.append(f"- `{name}`: `{run['command']}` ({run['seconds']:.0f} s){detail}")
        reruns: dict[str, list[str]] = {}
        for x in measures:
            if x["command"] == run["command"] and x.get("rerun"):
                reruns.setdefault(x["rerun"], []).append(x["title"].split(", vs ")[0])
        for how, titles in reruns.items():
            lines.append(f"  - re-measured alone, with more rounds, by {how}: {'; '.join(dict.fromkeys(titles))}")
    for p in doc["catalog"]:
        lines.append(f"- catalog {p['n']:,}: `{p['command']}`")
    for name, how in doc.get("reused", {}).items():
        lines.append(f"- `{name}` was not re-run: its figures come from `{how}`")
    for miss in doc["missing"]:
        lines.append(f"- not run: {miss.splitlines()[0]}")
    lines += ["", "## Plots", ""]
    for title, file in plots:
        lines += [f"### {title}", "", f"![{title}]({os.path.relpath(file, path.parent)})", ""]
    path.write_text("\n".join(lines) + "\n")
    return path


def profile_lines(profiles: dict[str, Any], *, top: int = 8) -> list[str]:
    """Per profiled benchmark and section: a one-line summary, then the top functions by own time."""
    if not profiles:
        return []
    lines = ["", "## Profiles of the benchmarks that missed a target", "",
             "cProfile of a separate run at the quick sizes (the profiler slows what it watches, so no figure "
             "above comes from a profiled run), on only the section of the tool that the missed target times.", ""]
    for name, prof in profiles.items():
        if prof.get("error"):
            lines += [f"### `{name}`", "", f"Profiling failed: {prof['error']}", ""]
            continue
        lines += [f"### `{name}`", "", f"`{prof['command']}` ({prof['scope']})", ""]
        for section, data in prof["sections"].items():
            funcs = data["functions"]
            lead = ", ".join(f"`{f['function']}` {100 * f['share']:.0f}%" for f in funcs[:3])
            lines += [f"**{section}**: {data['total_s']:.2f} s profiled; most own time in {lead}.", "",
                      "| function | calls | own s | cumulative s | share of own time |",
                      "| --- | --- | --- | --- | --- |"]
            lines += [f"| `{f['function']}` | {f['calls']:,} | {f['own_s']:.3f} | {f['cumulative_s']:.3f} | "
                      f"{100 * f['share']:.0f}% |" for f in funcs[:top]]
            lines.append("")
    return lines


HEADLINE_START = "<!-- bench:headline:start -->"
HEADLINE_END = "<!-- bench:headline:end -->"
HEADLINE_KEYS = ("swap.", "moe_pack.", "batch.speedup.d1000", "store.publish_per_s.n1000000",
                 "store.resolve_p99_us.n1000000", "store.overhead.n1000000", "http.", "train.dense.n4", "train.moe.n4",
                 "mixed.prefill.n256.", "mixed.decode.n256.", "mixed.moe.prefill.n256.",
                 "replicas.lag_p99_ms.r3", "replicas.cold_start_s.n1000000", "replicas.failover_s.sigstop")


def headline_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| measure | ours | ratio | paper | target | met |", "| --- | --- | --- | --- | --- | --- |"]
    def rank(key: str) -> int:
        return next(i for i, prefix in enumerate(HEADLINE_KEYS) if key.startswith(prefix))

    shown = sorted((k for k in doc["measures"] if k.startswith(HEADLINE_KEYS)), key=rank)  # stable: run order kept
    for key in shown:
        x = doc["measures"][key]
        if x["target"] or x["paper"]:
            ratio = f"{x['ratio']:.2f}x" if x["ratio"] is not None else ""
            rows.append(f"| {x['title']} | {_fmt(x['ours'], x['unit'])} | {ratio} | {x['paper']} | {x['target']} | "
                        f"{_met(x)} |")
    return rows


def update_readme(doc: dict[str, Any], readme: Path, report: str) -> bool:
    """Replace the headline table between the markers in the README (generated, never typed)."""
    text = readme.read_text()
    if HEADLINE_START not in text or HEADLINE_END not in text:
        return False
    head, rest = text.split(HEADLINE_START, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    body = [f"Generated by `tools/bench_all.py` on {doc['machine']['cpu']}, {doc['machine']['cores']} cores "
            f"(report written at commit `{doc['machine']['commit']}`"
            + ("; some runs reused from earlier results, dated in the report" if doc.get("reused") else "")
            + f"); every measure, baseline and command: [{report}]({report}).", "",
            *headline_rows(doc)]
    readme.write_text(head + HEADLINE_START + "\n" + "\n".join(body) + "\n" + HEADLINE_END + tail)
    return True


def make_plots(doc: dict[str, Any], plots_dir: Path) -> list[tuple[str, Path]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plots_dir.mkdir(parents=True, exist_ok=True)
    out: list[tuple[str, Path]] = []
    sub = f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores ({doc['mode']} run)"

    def save(fig: Any, name: str, title: str) -> None:
        fig.suptitle(title, fontsize=11)
        for ax in fig.axes:  # log axes label minor ticks too, and those collide
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        fig.text(0.5, -0.06, sub, ha="center", fontsize=7, color="gray")  # under the axis label
        file = plots_dir / name
        fig.savefig(file, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append((title, file))

    cat = doc["catalog"]
    if cat:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ns = [p["n"] for p in cat]
        ax.plot(ns, [p["resolve_p50_us"] for p in cat], "o-", label="resolve p50")
        ax.plot(ns, [p["resolve_p99_us"] for p in cat], "o--", label="resolve p99")
        ax.plot(ns, [p["read_us"] for p in cat], "s-", label="row read + verify (ours)")
        ax.plot(ns, [p["raw_read_us"] for p in cat], "s--", label="raw os.pread")
        ax.set_xscale("log")
        ax.set_xlabel("adapters in the catalog")
        ax.set_ylabel("microseconds per call")
        ax.legend(fontsize=8)
        save(fig, "catalog.png", "Resolve and read latency against catalog size")
    batch = doc["runs"].get("batch")
    if batch:
        rows = batch["results"]["batching"]
        toks = rows[0]["seqs"] * rows[0]["seq_len"]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        d = [r["distinct"] for r in rows]
        ax.plot(d, [toks / r["batched_s"] for r in rows], "o-", label="one mixed batch")
        ax.plot(d, [toks / r["one_at_a_time_s"] for r in rows], "o--", label="one adapter at a time")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("distinct adapters in the batch")
        ax.set_ylabel("tokens per second")
        ax.legend(fontsize=8)
        save(fig, "batch.png", "Batch throughput against distinct adapters per batch")
    swap = doc["runs"].get("swap")
    if swap and swap["results"].get("cases"):
        cases = swap["results"]["cases"]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        probe = swap["results"].get("probe")
        points = [(c["name"], c["adapter_bytes"], c["switch"], c.get("bytes_us")) for c in cases]
        if probe:
            points.insert(0, ("small row", probe["row_bytes"], probe["switch"], probe.get("bytes_us")))
        for name, nbytes, sw, _parts in points:
            dot = ax.scatter([nbytes], [sw["cold"]["p50"] / 1e3], label=f"{name} cold")
            ax.scatter([nbytes], [sw["warm"]["p50"] / 1e3], marker="x", color=dot.get_facecolor(),
                       label=f"{name} warm")
        copy = [(n, p["memcpy"]["p50"] / 1e3) for _, n, _, p in points if p and "memcpy" in p]
        if copy:
            copy.sort()
            ax.plot([n for n, _ in copy], [t for _, t in copy], ":", color="gray", label="one memcpy of the row")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("adapter bytes")
        ax.set_ylabel("switch latency (ms)")
        ax.legend(fontsize=7)
        save(fig, "switch_latency.png", "Switch latency against adapter size and rank")
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        names = [c["name"] for c in cases]
        xs = list(range(len(cases)))
        series = [("full base reload", "reload_vs_cold"), ("PEFT load_adapter", "peft_vs_cold"),
                  ("vLLM add_lora", "vllm_vs_cold")]
        width = 0.8 / len(series)
        for k, (label, key) in enumerate(series):
            ratios = [c["ratio"].get(key) or 0 for c in cases]
            if any(ratios):
                ax.bar([x + (k - 1) * width for x in xs], ratios, width, label=f"ours vs {label}")
        ax.scatter([x - width for x in xs], [c.get("bound", 0) for c in cases], marker="_", s=300, color="black",
                   zorder=3, label="bound vs reload: base bytes / adapter bytes")
        paper = {"dense-r1": 18.3, "moe-r1": 2.85}
        ax.scatter([x - width for x, n in zip(xs, names, strict=True) if n in paper],
                   [paper[n] for n in names if n in paper], color="red", zorder=3, label="paper, vs reload")
        ax.set_xticks(xs, names)
        ax.set_yscale("log")
        ax.set_ylabel("speedup of a cold switch")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside: bars reach the top
        save(fig, "switch_ratio.png", "Switch speedup, dense against MoE")
    return out


def compare(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """What got faster or slower between two results files (matched on measure keys)."""
    lines = []
    for key, m in new["measures"].items():
        o = old.get("measures", {}).get(key)
        if o is None:
            lines.append(f"new      {m['title']}: {_fmt(m['ours'], m['unit'])}")
            continue
        if not o["ours"]:
            continue
        change = m["ours"] / o["ours"] - 1
        better = change > 0 if m["higher_is_better"] else change < 0
        word = "same" if abs(change) < 0.05 else ("better" if better else "worse")
        lines.append(f"{word:8} {m['title']}: {_fmt(o['ours'], o['unit'])} -> {_fmt(m['ours'], m['unit'])} "
                     f"({change:+.0%})")
    for key in old.get("measures", {}).keys() - new["measures"].keys():
        lines.append(f"gone     {old['measures'][key]['title']}")
    return lines


def load(path: str | Path) -> dict[str, Any]:
    return dict(json.loads(Path(path).read_text()))
