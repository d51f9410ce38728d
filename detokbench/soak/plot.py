"""The soak's PNG: RSS over time above, live requests and tokens decoded below."""

from __future__ import annotations

from pathlib import Path


def plot(samples: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [s["rss_mb"] for s in samples], color="tab:blue")
    ax1.set_ylabel("detokd RSS (MB)")
    f = summary["flatness"]
    ax1.set_title(
        f"{summary['tokens'] / 1e6:.1f}M tokens, {summary['requests']:,} requests, max_states {summary['max_states']:,}: "
        f"RSS {'flat' if f.get('flat') else 'NOT flat'} (last quarter {f.get('last_quarter_growth', 0):+.2%})",
        fontsize=10,
    )
    rss = [s["rss_mb"] for s in samples]
    mid = (max(rss) + min(rss)) / 2
    half = max(10.0, (max(rss) - min(rss)) * 0.6)  # at least a 20 MB window: noise stays small
    ax1.set_ylim(mid - half, mid + half)
    ax1.axvspan(0.75 * t[-1], t[-1], color="0.9")
    ax2.plot(t, [s["live"] for s in samples], color="tab:orange", label="live requests (/metrics)")
    ax2.axhline(summary["max_states"], color="tab:red", ls="--", lw=1, label="max_states")
    ax2.set_ylabel("live requests")
    ax2.set_xlabel("seconds")
    ax3 = ax2.twinx()
    ax3.plot(t, [s["tokens"] / 1e6 for s in samples], color="tab:green", label="tokens (M)")
    ax3.set_ylabel("tokens decoded (M)")
    h1, l1 = ax2.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
