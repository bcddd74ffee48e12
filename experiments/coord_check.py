"""µP's coordinate check (Yang et al. 2022, "Tensor Programs V", section 7 / Fig. 5), across
training steps: the RMS of each layer's activations at steps 0..k for a range of widths,
under the standard parametrisation (SP) and under µP (model.mup_base_width).

    python -m experiments.coord_check --out runs/coord_check   # runs/coord_check.json, .png

Each width trains experiments/configs/mup_transfer.py's model (2 layers, 4 heads, mlp
4 x width, untied embeddings) with its optimizer (train/optim.py: AdamW; µP's per-class
lr), through the real train step (train/step.py), on held-out Shakespeare bytes, at a
constant lr with no warmup, so step 1 already takes a full-size update. After each step
the probe batch's activations (experiments/probes.py activation_rms) are measured, with
the RMS of their change since step 0 (`delta`): under µP both stay O(1) as the width
grows (the curves over width are flat); under SP the updates' effect on the logits and
the residual stream grows with width.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments import probes
from experiments.configs import mup_transfer
from experiments.report import style as report_style
from train.data.tokenizers import ByteTokenizer
from train.optim import make_optimizer
from train.state import init_state
from train.step import make_train_step
from train.spec import model_config

WIDTHS = (64, 128, 256, 512)


def _setup(width: int, param: str, base_width: int, lr: float, seed: int):
  c = mup_transfer.get_config(None)
  c.model.update(d_model=width, mlp_dim=4 * width, scan_layers=False,
                 mup_base_width=base_width if param == "mup" else 0)
  c.train.update(lr=lr, warmup_steps=0, seed=seed)
  return c, model_config(c)


def _batch(tokens_BL: np.ndarray) -> dict:
  B, L = tokens_BL.shape[0], tokens_BL.shape[1] - 1
  return {"inputs": jnp.asarray(tokens_BL[:, :-1]), "targets": jnp.asarray(tokens_BL[:, 1:]),
          "positions": jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)),
          "segment_ids": jnp.ones((B, L), jnp.int32), "weights": jnp.ones((B, L), jnp.float32)}


def run_width(width: int, param: str, *, base_width: int, steps: int, lr: float, seed: int,
              tokens_BL: np.ndarray) -> dict:
  """{"rms": {layer: [step 0..steps]}, "delta": {layer: [...]}, "loss": [...]}: one width.
  `tokens_BL` [steps + 1, B, L + 1]: batch 0 is the probe batch and step 1's batch."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  c, cfg = _setup(width, param, base_width, lr, seed)
  optimizer = make_optimizer(c.train, cfg)
  state = nn.unbox(init_state(cfg, optimizer, seed, tokens_BL.shape[-1] - 1))
  step_fn = jax.jit(make_train_step(cfg, c.train, optimizer))
  probe_BL = tokens_BL[0, :, :-1]
  ref = _layers(cfg, *probes.capture(cfg, state.params, probe_BL))  # Step 0's activations.
  out = {"rms": {}, "delta": {}, "loss": []}
  for t in range(steps + 1):
    if t:
      state, metrics = step_fn(state, _batch(tokens_BL[t - 1]))
      out["loss"].append(float(metrics["ce_loss"]))
    now = _layers(cfg, *probes.capture(cfg, state.params, probe_BL)) if t else ref
    for name, x in now.items():
      out["rms"].setdefault(name, []).append(_rms(x))
      out["delta"].setdefault(name, []).append(_rms(x - ref[name]))
  return out


def _layers(cfg, logits_BLV, inter: dict) -> dict:
  """The activations the check follows (activation_rms's names)."""
  out = {"embed": inter["embedded_BLD"]}
  for i in range(cfg.num_layers):
    out.update({f"layer_{i}/attn": inter[f"layer_{i}/attn"],
                f"layer_{i}/ffn": inter[f"layer_{i}/ffn"], f"layer_{i}": inter[f"layer_{i}"]})
  out["logits"] = logits_BLV
  return out


def _rms(x) -> float:
  x = jnp.asarray(x, jnp.float32)
  return float(jnp.sqrt(jnp.mean(x * x)))


def coord_check(widths=WIDTHS, params=("sp", "mup"), steps: int = 5, lr: float = 1e-2,
                seed: int = 0, batch: int = 8, seq_len: int = 64) -> dict:
  """{param: {width: run_width(...)}} with the first width as µP's base width."""
  ids = probes.text_tokens(ByteTokenizer(), batch=(steps + 1) * batch, seq_len=seq_len + 1)
  tokens_BL = ids.reshape(steps + 1, batch, seq_len + 1)
  return {p: {str(w): run_width(w, p, base_width=widths[0], steps=steps, lr=lr, seed=seed,
                                tokens_BL=tokens_BL) for w in widths} for p in params}


def growth(result: dict, kind: str = "delta", step: int = -1) -> dict:
  """{param: {layer: value at the widest / at the narrowest width}} at `step`: ~1 under µP
  for every layer; SP's grows with the width ratio for the logits."""
  out = {}
  for p, by_width in result.items():
    ws = sorted(by_width, key=int)
    lo, hi = by_width[ws[0]][kind], by_width[ws[-1]][kind]
    out[p] = {name: hi[name][step] / lo[name][step] if lo[name][step] else math.nan
              for name in lo}
  return out


def plot(result: dict, path: str, kind: str = "delta") -> None:
  """One panel per (param, activation), x = width (log), one line per step."""
  plt = report_style.pyplot()
  if plt is None:
    return
  params = list(result)
  names = list(next(iter(result[params[0]].values()))[kind])
  shown = [n for n in names if n in ("embed", "logits") or n.endswith(("/attn", "/ffn"))]
  with plt.rc_context(report_style.PAPER_STYLE):
    fig, axes = plt.subplots(len(params), len(shown), squeeze=False, sharex=True,
                             figsize=(1.2 * len(shown) + 0.6, 1.3 * len(params) + 0.5))
    for r, p in enumerate(params):
      widths = sorted(result[p], key=int)
      steps = len(result[p][widths[0]][kind][shown[0]])
      for col, name in enumerate(shown):
        ax = axes[r][col]
        for t in range(1 if kind == "delta" else 0, steps):
          ax.plot([int(w) for w in widths], [result[p][w][kind][name][t] for w in widths],
                  marker=".", color=plt.cm.viridis(t / max(steps - 1, 1)), label=f"step {t}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{p.upper()}: {name}", fontsize=6)
        ax.grid(alpha=0.3)
        if r == len(params) - 1:
          ax.set_xlabel("width (d_model)")
      axes[r][0].set_ylabel("RMS of change since step 0" if kind == "delta" else "RMS")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=200, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m experiments.coord_check", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="path prefix: writes OUT.json, OUT.png")
  parser.add_argument("--widths", default="+".join(map(str, WIDTHS)))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  widths = tuple(int(w) for w in args.widths.split("+"))
  result = coord_check(widths, steps=args.steps, lr=args.lr, seed=args.seed)
  record = {"widths": widths, "steps": args.steps, "lr": args.lr, "seed": args.seed,
            "result": result, "growth_delta": growth(result, "delta"),
            "growth_rms": growth(result, "rms")}
  with open(args.out + ".json", "w") as f:
    json.dump(record, f, indent=1)
  plot(result, args.out + ".png", "delta")
  for p, g in record["growth_delta"].items():
    print(p, "change since step 0, widest / narrowest width at the last step:",
          ", ".join(f"{k} {v:.2f}" for k, v in g.items()))


if __name__ == "__main__":
  main()
