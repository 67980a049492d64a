"""PNG figures (matplotlib, Agg backend): speedup by method and category, per-position
acceptance, tokens/s against draft length."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def require_matplotlib() -> None:
    """Plots need matplotlib, which only the ``bench`` extra installs: say so (bench checks this
    before any model loads)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from tokenleap.bench.common import BenchError
        raise BenchError("tokenleap bench draws its plots with matplotlib, which is not installed: "
                         "pip install 'tokenleap[bench]'") from None


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(fig, path: Path, plt) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def speedup_groups(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The speedup plot's groups, (label, per-method table): overall, then each category when there are
    several (a list, not a dict: a dataset's category may itself be named "overall")."""
    by_cat = results["summary"]["by_category"]
    return [("overall", results["summary"]["overall"])] + (list(by_cat.items()) if len(by_cat) > 1 else [])


def speedup_plot(results: dict[str, Any], path: Path) -> str | None:
    """Grouped bars: one group per category (and overall), one bar per method other than plain."""
    groups = speedup_groups(results)
    methods = [m for m in results["summary"]["overall"] if m != "plain"]
    if not methods:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * (1 + len(methods) / 4)), 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        # (a group the method has no speedup in -- it never ran there -- gets no bar, not a 0.00 one)
        bars_at = [(g + (i - (len(methods) - 1) / 2) * width, (t.get(m) or {}).get("speedup"))
                   for g, (_, t) in enumerate(groups)]
        bars_at = [(x, y) for x, y in bars_at if y is not None]
        bars = ax.bar([x for x, _ in bars_at], [y for _, y in bars_at], width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], rotation=20 if len(groups) > 4 else 0)
    ax.set_ylabel("speedup over plain (median tok/s ratio)")
    ax.set_title("Speedup by method and category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path, plt)


def acceptance_plot(results: dict[str, Any], path: Path) -> str | None:
    """a_i against draft position i, one line per method that drafted."""
    curves = {m: f["per_position_acceptance"] for m, f in results["summary"]["overall"].items()
              if f.get("per_position_acceptance")}
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for m, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=m)
    _integer_x(ax)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("a_i = P(first i drafts accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def _by_draft_length(results: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """line -> [(k, tok/s)] for methods with a fixed numeric k: one line per family and its other options
    (``ngram:k=2,max=2`` and ``ngram:k=3,max=4`` differ in more than k, so they are not one curve)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for info in results["methods"]:
        k = info["options"].get("k")
        fig = results["summary"]["overall"].get(info["name"])
        if isinstance(k, int) and fig and fig["tokens_per_second"] is not None:
            rest = ",".join(f"{o}={v}" for o, v in sorted(info["options"].items()) if o != "k")
            out.setdefault(info["family"] + (f":{rest}" if rest else ""), []).append((k, fig["tokens_per_second"]))
    return {f: sorted(v) for f, v in out.items()}


def draft_length_plot(results: dict[str, Any], path: Path) -> str | None:
    """tok/s against k, for every family (and its other options) run with at least two fixed draft lengths."""
    series = {f: v for f, v in _by_draft_length(results).items() if len({k for k, _ in v}) >= 2}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for line, points in series.items():
        ax.plot([k for k, _ in points], [t for _, t in points], marker="o", label=line)
    _integer_x(ax)
    plain = (results["summary"]["overall"].get("plain") or {}).get("tokens_per_second")
    if plain:
        ax.axhline(plain, color="black", linewidth=0.8, linestyle="--", label="plain")
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("Tokens/s against draft length")
    ax.legend(fontsize=8)
    return _save(fig, path, plt)


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    require_matplotlib()
    made = [speedup_plot(results, out / "speedup.png"), acceptance_plot(results, out / "acceptance.png"),
            draft_length_plot(results, out / "tokens_per_s_vs_k.png")]
    return [p for p in made if p]
