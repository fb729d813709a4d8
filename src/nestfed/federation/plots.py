"""A run's plots, rendered to PNG bytes (matplotlib, Agg).

Held-out perplexity per client per round, and the bytes sent each round.
nestfed.federation.run_dir writes them atomically into plots/.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from nestfed.config import INLINE_CLIENTS


def pyplot():
    """Import matplotlib.pyplot on the Agg backend, on first use.

    A Flower ClientApp process, which imports the round loop but never plots, does not pay its
    second of import.

    Returns:
        The matplotlib.pyplot module.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """Render a figure as PNG bytes (110 dpi), and close it.

    Args:
        fig: a matplotlib figure.

    Returns:
        The PNG bytes.
    """
    plt = pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    return buf.getvalue()


def run_plots(lines: list[dict[str, Any]], title: str, ranks: dict[str, int] | None = None) -> dict[str, bytes]:
    """Render a run's plots.

    Args:
        lines: the run's metrics lines (``round``, ``bytes_down``, ``bytes_up``, and ``eval``
            {cid: metrics} when the round evaluated).
        title: the plots' title prefix.
        ranks: {cid: r_k}; with more than `nestfed.config.INLINE_CLIENTS` clients the evaluation
            is plotted by rank group.

    Returns:
        {file name: PNG bytes}: ``eval_ppl.png`` (held-out perplexity per round: one line per
        client, or, beyond `nestfed.config.INLINE_CLIENTS` clients, the mean of each rank group
        with its 10th-90th percentile band), ``ppl_ecdf.png`` (many clients: the final
        perplexity's empirical distribution per rank group) and ``bytes.png`` (MB sent down and
        up per round). The evaluation plots only when some rounds carry evaluations.
    """
    plt = pyplot()
    out = {}
    evaluated = [ln for ln in lines if ln.get("eval")]
    many = ranks is not None and len(ranks) > INLINE_CLIENTS
    if evaluated and not many:
        cids = sorted({c for ln in evaluated for c in ln["eval"]}, key=int)
        fig, ax = plt.subplots(figsize=(6, 4))
        for cid in cids:
            xs = [ln["round"] for ln in evaluated if cid in ln["eval"]]
            ys = [ln["eval"][cid]["ppl"] for ln in evaluated if cid in ln["eval"]]
            ax.plot(xs, ys, marker="o", label=f"client {cid}")
        ax.set_xlabel("round")
        ax.set_ylabel("held-out perplexity")
        ax.set_title(f"{title}: perplexity per client")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out["eval_ppl.png"] = png(fig)
    elif evaluated:
        out.update(group_plots(evaluated, title, ranks))
    rounds = [ln for ln in lines if ln["round"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [ln["round"] for ln in rounds]
    ax.bar([x - 0.2 for x in xs], [ln["bytes_down"] / 1e6 for ln in rounds], width=0.4, label="server -> clients")
    ax.bar([x + 0.2 for x in xs], [ln["bytes_up"] / 1e6 for ln in rounds], width=0.4, label="clients -> server")
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round (all clients)")
    ax.set_title(f"{title}: communication")
    ax.legend()
    out["bytes.png"] = png(fig)
    return out


def group_plots(evaluated: list[dict[str, Any]], title: str, ranks: dict[str, int]) -> dict[str, bytes]:
    """Plot the evaluation of many clients by rank group (see `run_plots`).

    Args:
        evaluated: the metrics lines that carry ``eval`` ({cid: metrics}), at least one.
        title: the plots' title prefix.
        ranks: {cid: r_k}.

    Returns:
        {file name: PNG bytes}: ``eval_ppl.png`` (over the clients every evaluated round has: the
        panel, when rounds between the first and last evaluate one) and ``ppl_ecdf.png`` (the
        last evaluated round's clients).
    """
    plt = pyplot()
    common = set.intersection(*(set(ln["eval"]) for ln in evaluated))  # the curve follows the same clients
    groups = sorted({ranks[c] for c in common})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in groups:
        xs, mean, lo, hi = [], [], [], []
        for ln in evaluated:
            ppl = [m["ppl"] for c, m in ln["eval"].items() if c in common and ranks[c] == r]
            if ppl:
                xs.append(ln["round"])
                mean.append(float(np.mean(ppl)))
                lo.append(float(np.percentile(ppl, 10)))
                hi.append(float(np.percentile(ppl, 90)))
        (line,) = ax.plot(xs, mean, marker="o", label=f"rank {r} (mean)")
        ax.fill_between(xs, lo, hi, alpha=0.15, color=line.get_color())
    ax.set_xlabel("round")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(
        f"{title}: mean per rank group, 10th-90th percentile band\n(the {len(common)} clients evaluated every round)",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out = {"eval_ppl.png": png(fig)}
    last = evaluated[-1]["eval"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in groups:
        ppl = np.sort([m["ppl"] for c, m in last.items() if ranks[c] == r])
        if ppl.size:
            ax.step(ppl, np.arange(1, ppl.size + 1) / ppl.size, where="post", label=f"rank {r} ({ppl.size} clients)")
    ax.set_xlabel(f"held-out perplexity after round {evaluated[-1]['round']}")
    ax.set_ylabel("share of clients at or below")
    ax.set_title(f"{title}: distribution over clients per rank group")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out["ppl_ecdf.png"] = png(fig)
    return out
