"""The scaling plot: efficiency and MFU against device count, one line per hardware profile, to a PNG."""

from __future__ import annotations

from typing import Any


def plot_scaling(curves: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """Scaling efficiency and MFU vs device count, one line per hardware profile, to a PNG."""
    # Imported here: matplotlib is the optional `plot` extra (pyproject.toml), and the headless Agg
    # backend has to be chosen before pyplot is imported. Not a project import; no cycle involved.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eff, ax_mfu) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Profiles that differ only in what the step does not depend on (H100 and H200 at one width
    # are compute-bound alike) draw the same line: each gets its own marker and dash, so a line
    # drawn exactly under another still shows.
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1))), ("x", "-")]
    for i, (name, rows) in enumerate(curves.items()):
        marker, dash = styles[i % len(styles)]
        pts = [r for r in rows if r.get("efficiency") is not None]
        if not pts:
            continue
        xs = [r["devices"] for r in pts]
        style = dict(marker=marker, linestyle=dash, markerfacecolor="none", label=name)
        ax_eff.plot(xs, [100 * r["efficiency"] for r in pts], **style)
        ax_mfu.plot(xs, [100 * r["mfu"] for r in pts], **style)
    for ax, label in ((ax_eff, "scaling efficiency (%)"), (ax_mfu, "predicted MFU (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "weak scaling (best fitting layout per device count)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
