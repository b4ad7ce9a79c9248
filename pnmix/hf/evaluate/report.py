"""The results as rich tables and as a PNG (KL against bits per element; passkey accuracy)."""

from __future__ import annotations

import io
from typing import Any, Dict, List


from ...errors import PnMixError
from .methods import REFERENCE
from .passkey import REFERENCE_PASS


def print_tables(report: Dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    if report["results"]:
        table = Table(title=f"{report['model']}: teacher-forced decode vs {REFERENCE} (KL(p_{REFERENCE} || p))")
        for column in ("context", "method", "bits/elem", "bytes", "KL", "perplexity", "Δppl", "top-1",
                       "tok/s"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in report["results"]:
            table.add_row(f"{row['context']}+{row['decode_tokens']}", row["method"],
                          f"{row['bits_per_element']:.2f}", f"{row['bytes']:,}", f"{row['kl']:.4f}",
                          f"{row['perplexity']:.3f}", f"{row['ppl_delta']:+.3f}", f"{row['top1']:.3f}",
                          f"{row['tokens_per_s']:.1f}")
        console.print(table)
    for task in passkey_tasks(report["passkey"]):
        rows = [row for row in report["passkey"] if row["task"] == task]
        lengths = sorted({row["length"] for row in rows})
        methods = list(dict.fromkeys(row["method"] for row in rows))
        failed = reference_failures(rows)
        table = Table(title=f"{report['model']}: {task} accuracy ({rows[0]['key_digits']}-digit keys, "
                            f"{rows[0]['haystack']} haystack; mean over depths)")
        table.add_column("method")
        for length in lengths:
            table.add_column(f"L={length}", justify="right")
        for method in methods:
            cells = [f"{passkey_accuracy(rows, method, length):.2f}" + ("!" if length in failed else "")
                     for length in lengths]
            table.add_row(method, *cells)
        console.print(table)
        if failed:  # one line under the table, not a caption wrapped to the table's width
            console.print(failure_note(failed), soft_wrap=True, highlight=False)


def failure_note(failed: Dict[int, List[float]]) -> str:
    cells = "; ".join(f"L={length} d={', '.join(f'{d:g}' for d in depths)}" for length, depths in failed.items())
    return f"! the reference fails at {cells} (right on fewer than {REFERENCE_PASS:.0%} of the keys): no test of the cache there"


def passkey_tasks(rows: List[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(row["task"] for row in rows))


def reference_failures(rows: List[Dict[str, Any]]) -> Dict[int, List[float]]:
    """{length: the depths whose cell the reference fails} over one task's rows."""
    failed: Dict[int, List[float]] = {}
    for row in rows:
        if row["reference_fails"] and row["depth"] not in failed.get(row["length"], []):
            failed.setdefault(row["length"], []).append(row["depth"])
    return failed


def passkey_accuracy(rows: List[Dict[str, Any]], method: str, length: int) -> float:
    """Accuracy over every trial of every depth at one length (rows of one task)."""
    cell = [r for r in rows if r["method"] == method and r["length"] == length]
    return sum(r["accuracy"] * r["trials"] for r in cell) / sum(r["trials"] for r in cell)


# ---- the picture --------------------------------------------------------------------------------
def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise PnMixError("--plot needs matplotlib: pip install 'pnmix[hf]'") from None
    matplotlib.use("Agg")
    return matplotlib


def render_plot(report: Dict[str, Any]) -> bytes:
    """PNG: KL (log) against bits per element per method, one panel per context; passkey accuracy
    per method and length."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    contexts = sorted({row["context"] for row in report["results"]})
    tasks = passkey_tasks(report["passkey"])
    panels = len(contexts) + len(tasks)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.2 * max(panels, 1), 4.4), squeeze=False)
    methods = list(dict.fromkeys([r["method"] for r in report["results"]] + [r["method"] for r in report["passkey"]]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    for ax, context in zip(axes[0], contexts):
        for row in (r for r in report["results"] if r["context"] == context and r["method"] != REFERENCE):
            star = row["method"] == "pnmix"
            ax.scatter(row["bits_per_element"], max(row["kl"], 1e-6), color=colors[row["method"]],
                       s=180 if star else 60, label=row["method"], marker="*" if star else "o")
            ax.annotate(row["method"], (row["bits_per_element"], max(row["kl"], 1e-6)), fontsize=8,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per K/V element (measured bytes)")
        ax.set_ylabel(f"mean KL(p_{REFERENCE} || p)  (lower is better)")
        ax.set_title(f"context {context} + {report['results'][0]['decode_tokens']} decoded")
        ax.grid(True, which="both", alpha=0.3)
    for ax, task in zip(axes[0][len(contexts):], tasks):
        rows = [r for r in report["passkey"] if r["task"] == task]
        lengths = sorted({r["length"] for r in rows})
        pk_methods = list(dict.fromkeys(r["method"] for r in rows))
        failed = reference_failures(rows)
        width = 0.8 / len(pk_methods)
        for i, method in enumerate(pk_methods):
            xs = [j + (i - (len(pk_methods) - 1) / 2) * width for j in range(len(lengths))]
            ax.bar(xs, [passkey_accuracy(rows, method, L) for L in lengths], width,
                   color=colors[method], label=method)
        ax.set_xticks(range(len(lengths)), [f"{L}" + ("\n(reference fails)" if L in failed else "") for L in lengths])
        ax.set_xlabel("passkey sequence length (tokens)")
        ax.set_ylabel("accuracy (all digits right)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{task} ({rows[0]['key_digits']}-digit keys), mean over depths")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)  # clear of the bars
    fig.suptitle(f"{report['model']}: KV-cache methods vs {REFERENCE}")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")  # the legend outside the axes
    plt.close(fig)
    return buffer.getvalue()
