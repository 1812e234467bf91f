"""`--plot FILE.png`: histograms of TTFT, TPOT, ITL and E2EL with their mean, median and p99
marked. matplotlib is an optional extra (`pip install 'jaxserve[bench]'`); the figure is drawn
without pyplot, so no global backend is switched in the calling process."""

from __future__ import annotations

from jaxserve.server.bench.metrics import METRICS, RequestOutcome

INSTALL_HINT = "pip install 'jaxserve[bench]' (or pip install matplotlib)"


def require_matplotlib() -> None:
    """Raise a ValueError naming --plot and the install command when matplotlib is missing
    (checked before the run, not after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"--plot needs matplotlib, an optional extra: {INSTALL_HINT}") from None


def plot_latencies(result: dict, outcomes: list[RequestOutcome], path: str) -> None:
    from matplotlib.figure import Figure
    ok = [o for o in outcomes if o.success]
    values = {"ttft": [o.ttft for o in ok], "tpot": [o.tpot for o in ok if o.tpot is not None],
              "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok]}
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, xs) in zip(axes, values.items()):
        name, header = METRICS[key]
        ms = [x * 1000 for x in xs]
        ax.hist(ms or [0.0], bins=min(50, max(5, len(ms) // 4)), color="tab:blue", alpha=0.8)
        for stat, style in (("mean", "-"), ("median", "--")):
            ax.axvline(result[f"{stat}_{key}_ms"], color="black", linestyle=style, label=stat)
        p99 = result.get(f"p99_{key}_ms")
        if p99 is not None:
            ax.axvline(p99, color="tab:red", linestyle=":", label="p99")
        ax.set_title(f"{header} ({name})")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        ax.legend()
    fig.suptitle(f"{result['completed']} requests, {result['request_throughput']:.2f} req/s, "
                 f"{result['output_throughput']:.1f} output tok/s")
    fig.savefig(path, dpi=100)
