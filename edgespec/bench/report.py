"""Writing a benchmark's results: JSON, a markdown table, PNG plots.

Every file is written to a temporary name in the output folder and renamed
into place, so an interrupted run never leaves a half-written file.
"""
from __future__ import annotations

import json
import os
import tempfile
from importlib import resources
from pathlib import Path

from ..files import write_atomic

PLOTS = ("speedup.png", "speedup_by_language.png", "acceptance_vs_length.png", "ceiling_fraction.png",
         "roofline.png")
ROOFLINE_PLOTS = ("roofline.png",)   # of a `--roofline` run


def schema() -> dict:
    """The JSON Schema the results document follows (results.schema.json)."""
    return json.loads(resources.files(__package__).joinpath("results.schema.json").read_text())


def _fmt(x, spec: str, none: str = "–") -> str:
    return none if x is None else format(x, spec)


def _machine(h: dict) -> str:
    return (f"{h['cpu']}, {h['physical_cores'] or '?'} cores ({h['logical_cores']} logical), "
            f"{', '.join(h['simd']) or 'no SIMD flags read'}, {h['ram_gib']} GiB, {h['os']}")


def roofline_markdown(r: dict | None) -> list[str]:
    """The roofline section of results.md: memory, then compute."""
    if r is None:
        return []
    b = r["bytes_per_token"]
    sizes = "/".join(str(k) for k in r["batch_sizes"])
    lines = [
        "## Memory roofline", "",
        f"Read bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s ({r['threads']} threads); a decoded token "
        f"reads {b['total'] / 1e6:.1f} MB (weights {b['weights'] / 1e6:.1f} MB, KV cache {b['kv_cache'] / 1e6:.2f} MB "
        f"at {b['context']} positions): roofline {r['roofline_tokens_per_s']:.1f} tokens/s.", "",
        f"| backend | decode tok/s | of roofline | batch cost of {sizes} tokens (x one token) |",
        "| --- | ---: | ---: | --- |",
    ]
    for x in r["backends"]:
        if x["status"] != "ok":
            lines.append(f"| {x['backend']} | failed: {x['error']} | | |")
            continue
        lines.append(f"| {x['backend']} | {x['decode_tokens_per_s']:.1f} | {x['fraction_of_roofline']:.0%} "
                     f"| {' / '.join(f'{c:.2f}' for c in x['batch_cost'])} |")
    def ms(seconds: list[float]) -> str:
        return " / ".join(f"{1e3 * t:.1f}" for t in seconds)

    lines += [
        "", "## Compute roofline", "",
        f"int8 peak {r['int8_peak_macs_per_s'] / 1e9:.0f} GMAC/s ({r['threads']} threads, {r['kernels']} kernels); "
        f"a token multiplies {r['macs_per_token'] / 1e9:.2f} GMAC. Per batch of {sizes} tokens: memory floor "
        f"{ms(r['memory_floor_s'])} ms, compute floor {ms(r['compute_floor_s'])} ms.", "",
        f"| backend | batch of {sizes} tokens (ms) | fraction of the int8 peak |",
        "| --- | --- | --- |",
    ]
    for x in r["backends"]:
        if x["status"] == "ok":
            lines.append(f"| {x['backend']} | {ms(x['batch_seconds'])} "
                         f"| {' / '.join(f'{f:.0%}' for f in x['fraction_of_int8_peak'])} |")
    return lines


def markdown(doc: dict) -> str:
    if doc.get("kind") == "roofline":
        s, h = doc["settings"], doc["hardware"]
        lines = [f"# edgespec bench --roofline: {s['model']}", "",
                 f"{_machine(h)}; load average {h['load_average_start']} -> {h.get('load_average_end')}.", "",
                 *roofline_markdown(doc["roofline"])]
        return "\n".join(lines) + "\n"
    s, h, c = doc["settings"], doc["hardware"], doc["ceiling"]
    cost = " / ".join(f"{c['batch_cost'][k - 1]:.2f}" for k in (2, 4, 8, 16))
    lines = [
        f"# edgespec bench: {s['model']}",
        "",
        f"{_machine(h)}; {s['threads']} threads, backend {s['backend']}; load average {h['load_average_start']} -> "
        f"{h.get('load_average_end')}.",
        "",
        f"Suites {', '.join(s['suites']) or s['prompts_file']}, {len(doc['prompts'])} prompts, "
        f"{s['max_tokens']} tokens, {s['repeats']} repeat(s){' after a warm-up' if s['warmup'] else ''}, "
        f"modes {', '.join(s['modes'])}. Machine ceiling: {c['speedup']:.2f}x "
        f"(draft length {c['draft_length']}, every draft accepted; batch cost of 2/4/8/16 tokens "
        f"{cost} x one token).",
        "",
        "| configuration | mode | decode tok/s | x plain | of ceiling | acceptance | accepted/step "
        "| TTFT s | prefill tok/s | peak RSS MiB | greedy mismatches |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["configurations"]:
        if r["status"] == "failed" and not r["runs"]:
            lines.append(f"| {r['name']} | {r['mode']} | failed: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['name']} | {r['mode']} | {_fmt(r['decode_tokens_per_s'], '.1f')} | {_fmt(r['speedup'], '.3f')} "
            f"| {_fmt(r['fraction_of_ceiling'], '.0%')} | {_fmt(r['acceptance_rate'], '.0%')} "
            f"| {_fmt(r['mean_accepted'], '.2f')} | {_fmt(r['ttft_s'], '.3f')} | {_fmt(r['prefill_tokens_per_s'], '.0f')} "
            f"| {_fmt(r['peak_rss_mib'], '.0f')} | {_fmt(r['greedy_mismatches'], 'd')} |")
    suites = sorted({k for r in doc["configurations"] for k in r["by_suite"]})
    if len(suites) > 1:
        lines += ["", "Speedup over plain decoding per suite (median of per-prompt ratios):", "",
                  "| configuration | mode | " + " | ".join(suites) + " |",
                  "| --- | --- |" + " ---: |" * len(suites)]
        for r in doc["configurations"]:
            if r["name"] == "edgespec:none":
                continue
            cells = [_fmt(r["by_suite"].get(x, {}).get("speedup"), ".3f") for x in suites]
            lines.append(f"| {r['name']} | {r['mode']} | " + " | ".join(cells) + " |")
    failed = {k: v for k, v in doc["peers"].items() if v["status"] == "failed"}
    if failed:
        lines += ["", "Peers that failed:", ""] + [f"- {k}: {v['error']}" for k, v in failed.items()]
    if doc["divergences"]:
        lines += ["", f"Greedy runs that differ from plain decoding: {len(doc['divergences'])} "
                  f"(first divergent context positions: "
                  f"{', '.join(str(d['context_position']) for d in doc['divergences'])})."]
    if doc.get("roofline"):
        lines += [""] + roofline_markdown(doc["roofline"])
    for n in doc["notes"]:
        lines += ["", f"Note: {n}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------


def _label(r: dict, modes: list[str]) -> str:
    return r["name"] if len(modes) == 1 else f"{r['name']} ({r['mode']})"


def plots(doc: dict, out_dir: Path) -> list[str]:
    """Write the PNG plots; returns their file names. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".png", dir=out_dir)
        os.close(fd)
        try:
            fig.savefig(tmp, dpi=110)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            plt.close(fig)
        written.append(name)

    if doc.get("kind") != "roofline":
        _run_plots(doc, plt, save)
    if doc.get("roofline"):
        _roofline_plot(doc["roofline"], doc["settings"]["model"], plt, save)
    return written


def _roofline_plot(r: dict, model: str, plt, save) -> None:
    """Decode speed against the roofline, and the batch cost curves."""
    ok = [x for x in r["backends"] if x["status"] == "ok"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar([x["backend"] for x in ok], [x["decode_tokens_per_s"] for x in ok])
    a1.axhline(r["roofline_tokens_per_s"], color="red", ls="--", lw=0.8,
               label=f"roofline {r['roofline_tokens_per_s']:.1f} tok/s "
                     f"({r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s)")
    for i, x in enumerate(ok):
        a1.text(i, x["decode_tokens_per_s"], f"{x['fraction_of_roofline']:.0%}", ha="center", va="bottom")
    a1.set_ylabel("decode tokens/s")
    a1.set_title(f"Decode against the memory roofline ({model})")
    a1.legend(fontsize=7)
    sizes = r["batch_sizes"]
    for x in ok:
        a2.plot(sizes, x["batch_cost"], marker="o", ms=3, label=x["backend"])
    a2.plot(sizes, sizes, color="gray", ls=":", lw=0.8, label="k x one token")
    if ok:  # the floor of a batch: the memory or the compute floor, in the first backend's one token
        t1 = ok[0]["batch_seconds"][0]
        a2.plot(sizes, [max(m, c) / t1 for m, c in zip(r["memory_floor_s"], r["compute_floor_s"])],
                color="red", ls="--", lw=0.8, label=f"floor (memory, {r['int8_peak_macs_per_s'] / 1e9:.0f} GMAC/s)")
    a2.axhline(1.0, color="black", lw=0.8)
    a2.set_xscale("log", base=2)
    a2.set_xticks(sizes)
    a2.set_xticklabels([str(k) for k in sizes])
    a2.set_xlabel("tokens in one batch")
    a2.set_ylabel("time / one token's")
    a2.set_title("Batch cost")
    a2.legend(fontsize=7)
    save(fig, "roofline.png")


def _run_plots(doc: dict, plt, save) -> None:
    """The plots of a full run: speedups, acceptance, share of the ceiling."""
    modes = doc["settings"]["modes"]
    ceiling = doc["ceiling"]["speedup"]
    rows = [r for r in doc["configurations"] if r["name"] != "edgespec:none" and r["runs"]]

    # 1. Speedup per configuration, per suite.
    suites = sorted({k for r in rows for k in r["by_suite"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows) * max(1, len(suites)) / 2), 4))
    width = 0.8 / max(1, len(suites))
    for j, suite in enumerate(suites):
        ax.bar([i + j * width for i in range(len(rows))],
               [r["by_suite"].get(suite, {}).get("speedup") or 0 for r in rows], width, label=suite)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(ceiling, color="red", ls="--", lw=0.8, label=f"machine ceiling {ceiling:.2f}x")
    ax.set_xticks([i + width * (len(suites) - 1) / 2 for i in range(len(rows))])
    ax.set_xticklabels([_label(r, modes) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("decode speed / edgespec plain")
    ax.set_title(f"Speedup over plain decoding ({doc['settings']['model']})")
    ax.legend(fontsize=7)
    save(fig, PLOTS[0])

    # 2. Speedup per language.
    langs = sorted({k for r in rows for k in r["by_lang"]})
    fig, ax = plt.subplots(figsize=(9, max(3, 0.12 * len(langs) * max(1, len(rows)) + 1)))
    height = 0.8 / max(1, len(rows))
    for j, r in enumerate(rows):
        ax.barh([i + j * height for i in range(len(langs))],
                [r["by_lang"].get(x, {}).get("speedup") or 0 for x in langs], height, label=_label(r, modes))
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks([i + height * (len(rows) - 1) / 2 for i in range(len(langs))])
    ax.set_yticklabels(langs, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("decode speed / edgespec plain")
    ax.set_title("Speedup per language")
    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
    save(fig, PLOTS[1])

    # 3. Acceptance against draft length (edgespec drafters).
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        pts = sorted((int(k), v["acceptance_rate"]) for k, v in r["acceptance_by_length"].items())
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=_label(r, modes))
    ax.set_xlabel("draft length (tokens, tree nodes for trees)")
    ax.set_ylabel("share of drafted tokens accepted")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance against draft length")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", transform=ax.transAxes)
    save(fig, PLOTS[2])

    # 4. Speedup as a fraction of the ceiling, next to the all-accepted curve.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(range(len(rows)), [r["fraction_of_ceiling"] or 0 for r in rows])
    a1.axhline(1.0, color="red", ls="--", lw=0.8)
    a1.set_xticks(range(len(rows)))
    a1.set_xticklabels([_label(r, modes) for r in rows], rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("speedup / machine ceiling")
    a1.set_title(f"Share of the ceiling ({ceiling:.2f}x)")
    curve = doc["ceiling"]["all_accepted_speedup"]
    a2.plot(range(1, len(curve) + 1), curve, marker=".")
    a2.axhline(1.0, color="black", lw=0.8)
    a2.set_xlabel("draft length k (every token accepted)")
    a2.set_ylabel("(k + 1) / cost(k + 1)")
    a2.set_title("Best speedup per draft length on this machine")
    save(fig, PLOTS[3])


def write(doc: dict, out_dir: Path) -> tuple[list[Path], str | None]:
    """Write results.json, results.md and the plots into ``out_dir``.
    Returns (files written, why there are no plots or None)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name, data in (("results.json", json.dumps(doc, indent=1, ensure_ascii=False) + "\n"),
                       ("results.md", markdown(doc))):
        write_atomic(out_dir / name, data.encode("utf-8"))
        files.append(out_dir / name)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return files, "matplotlib is not installed (pip install 'edgespec[bench]'): no plots"
    files += [out_dir / n for n in plots(doc, out_dir)]
    return files, None
