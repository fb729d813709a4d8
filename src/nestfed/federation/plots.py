"""A run's plots, rendered to PNG bytes (matplotlib, Agg): held-out perplexity per client per round,
and the bytes sent each round. nestfed.federation.run_dir writes them atomically into plots/."""

from __future__ import annotations

import io
from typing import Any



def pyplot():
    """matplotlib.pyplot on the Agg backend, imported on first use: a Flower ClientApp process,
    which imports the round loop but never plots, does not pay its second of import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """The figure as PNG bytes (110 dpi); the figure is closed."""
    plt = pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    return buf.getvalue()


def run_plots(lines: list[dict[str, Any]], title: str) -> dict[str, bytes]:
    """{file name: PNG bytes}: ``eval_ppl.png`` (held-out perplexity per client per round; only
    when the lines carry evaluations) and ``bytes.png`` (MB sent down and up per round)."""
    plt = pyplot()
    out = {}
    if lines and all(ln.get("eval") for ln in lines):
        cids = sorted(lines[0]["eval"], key=int)
        fig, ax = plt.subplots(figsize=(6, 4))
        for cid in cids:
            xs = [ln["round"] for ln in lines if cid in ln["eval"]]
            ys = [ln["eval"][cid]["ppl"] for ln in lines if cid in ln["eval"]]
            ax.plot(xs, ys, marker="o", label=f"client {cid}")
        ax.set_xlabel("round")
        ax.set_ylabel("held-out perplexity")
        ax.set_title(f"{title}: perplexity per client")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        out["eval_ppl.png"] = png(fig)
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
