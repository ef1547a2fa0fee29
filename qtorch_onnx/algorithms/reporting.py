"""The report files of the layer-wise algorithms (fast finetune, bias correction): a JSON document and a bar plot
of one quantity per layer, before and after, both written atomically."""
from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, Sequence

__all__ = ["save_before_after"]


def save_before_after(folder: str, stem: str, doc: Dict[str, Any], names: Sequence[str],
                      before: Sequence[float], after: Sequence[float], ylabel: str, title: str) -> Dict[str, str]:
    """Write ``<stem>.json`` (``doc``) and ``<stem>.png`` (per-layer bars of ``before`` / ``after`` on a log scale,
    values floored at 1e-30) into ``folder``, each atomically; returns ``{"json": path, "png": path}``."""
    from ..export import save_bytes_atomic

    paths = {"json": os.path.join(folder, f"{stem}.json"), "png": os.path.join(folder, f"{stem}.png")}
    save_bytes_atomic(json.dumps(doc, indent=2).encode(), paths["json"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(names)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(names) + 2), 4.0))
    ax.bar([x - 0.2 for x in xs], [max(v, 1e-30) for v in before], 0.4, label="before")
    ax.bar([x + 0.2 for x in xs], [max(v, 1e-30) for v in after], 0.4, label="after")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(list(names), rotation=90, fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    save_bytes_atomic(buf.getvalue(), paths["png"])
    return paths
