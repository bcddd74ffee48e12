"""The report figures' one style (every figure: plots.py, tasks.py,
scaling.py): one column of a two-column paper, no titles, readable axis labels
with units, legends outside the data; PNG and vector PDF."""

from __future__ import annotations

import os


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  matplotlib.use("Agg")  # No display: files only.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


# One column of a two-column paper (ICML, NeurIPS, ACL: ~3.25-3.3 in), 8 pt text.
COLUMN_WIDTH = 3.3
HEIGHT = 2.3
PAPER_STYLE = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "legend.fontsize": 7,
    "xtick.labelsize": 7, "ytick.labelsize": 7, "font.family": "DejaVu Sans",
    "lines.linewidth": 1.0, "lines.markersize": 3, "axes.linewidth": 0.6,
    "pdf.fonttype": 42, "ps.fonttype": 42,  # TrueType: editable, accepted by publishers.
    "savefig.bbox": "tight", "savefig.pad_inches": 0.02,
}


# Readable axis labels for the fields sweeps vary; any other field: its last name, spaced.
READABLE = {
    "model.num_kv_heads": "KV heads", "model.num_heads": "query heads",
    "model.pos_encoding": "positional encoding", "model.num_experts": "experts",
    "model.experts_per_token": "experts per token", "model.d_model": "model width",
    "model.num_layers": "layers", "model.mlp_dim": "FFN width", "model.rope_theta": "RoPE theta",
    "model.attention_type": "attention", "train.lr": "learning rate",
    "data.seq_len": "training length", "data.batch_size": "batch size",
    "data.vocab_size": "vocabulary size", "train.steps": "training steps",
    "model.rope_scaling": "RoPE scaling", "model.rope_scaling_factor": "RoPE scaling factor",
    "eval.rope_scaling": "zero-shot RoPE scaling",
    "eval.rope_scaling_factor": "zero-shot scaling factor",
    "model.rotary_fraction": "rotary fraction", "train.seed": "seed",
}
METRIC_NAMES = {"loss": "eval loss (nats/token)", "bpb": "eval bits per byte"}


def readable(field: str) -> str:
  """An axis label for a config path: "model.num_kv_heads" -> "KV heads"."""
  return READABLE.get(field, field.split(".")[-1].replace("_", " "))


def figure(plt, width: float = COLUMN_WIDTH):
  """A figure whose constrained layout shrinks the axes to make room for an outside
  legend: the saved file keeps the column's width."""
  return plt.subplots(figsize=(width, HEIGHT), layout="constrained")


def legend(ax, below: bool = False) -> None:
  """Outside the axes, on the right (or below, in one row): never over a curve or a
  point. The figure must have constrained layout (`figure`), which makes the room."""
  handles, labels = ax.get_legend_handles_labels()
  if not labels:  # No group finished yet: no labels to show.
    return
  if below:
    ax.figure.legend(handles, labels, loc="outside lower center", ncols=len(labels),
                     frameon=False)
  else:
    ax.figure.legend(handles, labels, loc="outside right upper", frameon=False)


def save(plt, fig, path: str) -> None:
  """PNG for a quick look, PDF (vector) for the paper."""
  fig.savefig(path, dpi=300)
  fig.savefig(os.path.splitext(path)[0] + ".pdf")
  plt.close(fig)
