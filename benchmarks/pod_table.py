"""The pod table of docs/PERFORMANCE.md, built on MaxText's anchors: each row a preset of
experiments/configs/pod.py at the topology, per-chip batch, sequence and remat policy
MaxText trains the same model with (`launch.py --mode compile`, one subprocess per row),
then one markdown table: fits, per-chip HBM (libtpu's), compile wall time, roofline
tokens/s/chip and MFU ESTIMATES beside MaxText's measured figure where published.

    python -m benchmarks.pod_table --out pod_table.json [--rows 8b@v6e-256,...] [--cache DIR]

Each row's JSON report is kept in --cache (default runs/pod_table/) and reused when its
command has not changed, so a rerun only compiles new or changed rows (a large row takes
minutes of CPU). Rows run one at a time (a subprocess each, at this process's niceness:
run it under `nice` on a shared machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

from experiments.configs import pod
from model.flops import quantized_params_per_token, training_flops_per_token
from train.aot.estimate import TERMS
from train.aot.topology import CHIPS, parse_topology
from train.spec import model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# MaxText's published configs (benchmarks/maxtext_*_model_configs.py, tpu-recipes): the
# topology, sequences per chip and remat policy each model trains with, and the measured
# throughput where one is published: 8b on v6e-256 from MaxText's optimized-models tiering
# page (https://github.com/AI-Hypercomputer/maxtext/blob/main/docs/reference/models/tiering.md:
# Llama 3.1 8B, 256 chips, SL 8192: 45.46% MFU, 7,207 tokens/s/device), 16b on v5e-256
# from its v5e configs' page (MaxText's MaxText/configs/v5e/ readme, "High Performance
# Model Configs on TPU v5e": 61.10% MFU on 1x v5e-256). The remat policy (and offload map) of each row is
# its preset's default (experiments/configs/pod.py REMAT): a row's command needs no
# memory flag, except llama2_7b's v5e recipe, which MaxText runs at seq 2048.


@dataclasses.dataclass(frozen=True)
class Row:
  """One pod-table row: a preset of experiments/configs/pod.py compiled for a topology."""
  preset: str
  topology: str
  per_chip: int  # Sequences per chip.
  flags: tuple[str, ...] = ()  # Extra --config.* flags (where the preset's recipe differs).
  num_slices: int = 1
  maxtext: str = ""  # MaxText's measured figure, as published.
  quant: str = ""  # A measured quantized-training speed-up published for this shape.

  @property
  def key(self) -> str:
    slices = f"x{self.num_slices}" if self.num_slices > 1 else ""
    return f"{self.preset}@{self.topology}{slices}"


ROWS = (
    Row("8b", "v6e-256", 4, maxtext="7,207 tokens/s/chip, 45.46% MFU"),
    Row("8b", "v5e-256", 2, quant="Marin int8: +17.4% tokens/s (8B, v5e-256)"),
    Row("llama2_7b", "v5e-256", 4, ("--config.model.remat=save_qkv_proj",
                                    "--config.data.seq_len=2048")),
    Row("llama2_7b", "v5p-128", 4),
    Row("16b", "v5e-256", 6, maxtext="61% MFU"),
    Row("mixtral", "v6e-256", 12, maxtext="3,645 tokens/s/chip"),
    Row("1b", "v5e-16", 8),
    Row("moe", "v5p-64", 8),
    Row("8b", "v5e-256", 2, ("--config.mesh.dcn_data=2",), num_slices=2),
    # Issue 47: MaxText's largest anchors (its trillium model configs; measured figures
    # from tpu-recipes' trillium step logs, see MAXTEXT_LARGE).
    Row("70b", "v6e-256", 4, maxtext="943 tokens/s/chip"),
    Row("405b", "v6e-256", 1, ("--config.mesh.dcn_fsdp=2",), num_slices=2,
        maxtext="139 tokens/s/chip"),
    Row("dsv3", "v6e-256", 1, ("--config.mesh.dcn_fsdp=2",), num_slices=2),
)
# Where the issue-47 rows come from: MaxText's
# https://github.com/AI-Hypercomputer/maxtext/blob/main/benchmarks/maxtext_trillium_model_configs.py
# (llama2_70b_4096: v6e-256, per_device_batch_size 4, remat full, seq 4096;
# llama3_1_405b_8192_fsdp_dcn: 2 x v6e-256, per_device_batch_size 1, ici fsdp 64 x tensor
# 4, dcn_fsdp 2, decoder_layer_input/q/k/v/out_proj offloaded, seq 8192; deepseek_v3_ep16:
# 2 x v6e-256, per_device_batch_size 1, ici fsdp 16 x expert 16, dcn_fsdp 2, capacity 1.0,
# decoder_layer_input offloaded, seq 8192), and the step logs of tpu-recipes' trillium
# Llama2-70B-MaxText page (943.086 Tokens/s/device) and Llama3.1-405B-MaxText page
# (139.307 Tokens/s/device), https://github.com/AI-Hypercomputer/tpu-recipes. No
# DeepSeek-V3 figure is published there.
MAXTEXT_LARGE = ("https://github.com/AI-Hypercomputer/maxtext/blob/main/benchmarks/"
                 "maxtext_trillium_model_configs.py")
GiB = 1024 ** 3


def command(row: Row, out: str) -> list[str]:
  batch = row.per_chip * parse_topology(row.topology, row.num_slices).num_chips
  slices = ["--num_slices", str(row.num_slices)] if row.num_slices > 1 else []
  return ["launch.py", "--mode", "compile", "--config",
          f"experiments/configs/pod.py:preset={row.preset},batch={batch}",
          "--topology", row.topology, *slices, *row.flags, "--compile_steps", "train",
          "--out", out]


def _out(row: Row, cache: str) -> str:
  return os.path.join(cache, f"{row.key.replace('@', '-')}.json")


def cached(row: Row, cache: str) -> dict | None:
  """The row's report from an earlier run of the same command, if there is one."""
  out = _out(row, cache)
  if os.path.exists(out):
    with open(out) as f:
      report = json.load(f)
    if report.get("command") == command(row, out):
      return report
  return None


def run_row(row: Row, cache: str) -> dict:
  out = _out(row, cache)
  cmd = command(row, out)
  if (report := cached(row, cache)) is not None:
    return report
  print(f"compiling: python {' '.join(cmd)}", flush=True)
  t0 = time.time()
  proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, text=True,
                        capture_output=True, check=False)
  if proc.returncode not in (0, 2) or not os.path.exists(out):  # 2: does not fit.
    tail = (proc.stdout + proc.stderr)[-2000:]
    return {"command": cmd, "error": tail}
  with open(out) as f:
    report = json.load(f)
  report.update(command=cmd, wall_s=round(time.time() - t0, 1), load=os.getloadavg(),
                maxtext=row.maxtext, quant=row.quant, per_chip=row.per_chip)
  with open(out, "w") as f:
    json.dump(report, f, indent=1)
  print(proc.stdout, flush=True)
  return report


def _row_line(r: dict) -> str:
  t = r["steps"]["train"]
  m = t["memory"]
  fits = "yes" if t["fits"] else f"**no** (+{(m['total'] - t['hbm_bytes']) / GiB:.1f} GiB)"
  roof = t.get("roofline")
  speed = (f"{_speed_cells(t, r)} | {flop_ratio(t):.2f}" if roof else "n/a | n/a | n/a")
  slices = f" x {r['num_slices']}" if r.get("num_slices", 1) > 1 else ""
  custom = r.get("config_fields", {}).get("model.remat_custom") or " ".join(r["command"])
  policy = r["remat"] + (" (offload)" if "offload" in custom else "")
  return (f"| {r['config']} ({r['params'] / 1e9:.2f}B) | {r['topology']}{slices} "
          f"({r['chips']} chips) | {t['shapes']['batch'] // r['chips']} x "
          f"{t['shapes']['length']} | {policy} | {fits} | {m['total'] / GiB:.1f} "
          f"({m['arguments'] / GiB:.1f} + {m['temporaries'] / GiB:.1f}) of "
          f"{t['hbm_bytes'] / GiB:.2f} | {r.get('wall_s', 0) / 60:.1f} min | {speed} "
          f"| {r.get('maxtext') or 'not published'} | {_int8_cell(r)} |")


def _int8_cell(r: dict) -> str:
  """"4,200 (+28%) | Marin ...": the int8 ESTIMATE, its ratio to the row's, the published."""
  t = r["steps"]["train"]
  preset = r["config"].removeprefix("pod_")  # experiments/configs/pod.py's name.
  est = int8_tokens_per_chip(r, int8_share(preset, t["shapes"]["length"]))
  cell = ("n/a" if est is None else f"{est:,.0f} ({est / _tokens_per_chip(r) - 1:+.0%})")
  return f"{cell} | {r.get('quant') or '-'}"


def _tokens_per_chip(r: dict) -> float:
  """The row's tokens/s/chip ESTIMATE: the corrected estimate's (train/aot/estimate.py)
  where the report has one, the roofline's otherwise."""
  t = r["steps"]["train"]
  est = t.get("estimate")
  return (est["tokens_per_s"] if est else t["tokens_per_s_estimate"]) / r["chips"]


def int8_share(preset: str, seq_len: int) -> float:
  """The share of the train step's FLOPs in model.quantization's dots: 6 x the quantized
  parameters per token (model/flops.py) over the model's training FLOPs per token, taken
  as the compiled FLOPs' share too (a remat recomputes projections and attention alike)."""
  cfg = model_config(pod.get_config(f"preset={preset}"))
  return 6 * quantized_params_per_token(cfg) / training_flops_per_token(cfg, seq_len)


def int8_tokens_per_chip(r: dict, share: float) -> float | None:
  """The row's ESTIMATE with `share` of its compute at the chip's int8 peak (its other
  terms, HBM, collectives, DCN and host link, kept as the bf16 row's: a bound, as the
  quantized step moves fewer bytes); a row compiled quantized is its own estimate."""
  t = r["steps"]["train"]
  roof = t.get("roofline")
  if not roof:
    return None
  if t.get("matmuls", {}).get("s8"):
    return _tokens_per_chip(r)
  chip = CHIPS[r["topology"].split(":")[0]]
  est = t.get("estimate")
  times = ({k: est[f"{k}_s"] for k in TERMS} if est else
           {"compute": roof["compute_s"], "hbm": roof["hbm_s"], "ici": roof["collective_s"]})
  step = max(times.values())
  times["compute"] *= 1 - share + share * chip.peak_flops / chip.int8_peak_flops
  return _tokens_per_chip(r) * step / max(times.values())


def maxtext_figures(text: str) -> dict[str, float]:
  """MaxText's published figure(s) of a row: {"tokens": per second per chip, "mfu"}."""
  out = {}
  if m := re.search(r"([\d,]+) tokens/s/chip", text or ""):
    out["tokens"] = float(m.group(1).replace(",", ""))
  if m := re.search(r"([\d.]+)% MFU", text or ""):
    out["mfu"] = float(m.group(1)) / 100
  return out


def _speed_cells(t: dict, r: dict) -> str:
  """Tokens/s/chip and MFU, the corrected ESTIMATE (train/aot/estimate.py: + host link,
  DCN, head re-reads) where the report has it, the roofline alone otherwise; each with
  its ratio to MaxText's measured figure where one is published."""
  est, roof = t.get("estimate"), t["roofline"]
  tokens = (est["tokens_per_s"] if est else t["tokens_per_s_estimate"]) / r["chips"]
  mfu = est["mfu"] if est else t["mfu_estimate"]
  bound = est["bound"] if est else roof["bound"]
  published = maxtext_figures(r.get("maxtext", ""))
  vs = lambda key, v: (f"; {v / published[key]:.2f}x MaxText's" if key in published else "")
  alone = (f" (roofline alone: {t['tokens_per_s_estimate'] / r['chips']:,.0f})"
           if est else " (roofline alone)")
  return (f"{tokens:,.0f}{alone}{vs('tokens', tokens)} | {mfu:.0%} "
          f"({bound}-bound{_untrusted(t)}{vs('mfu', mfu)})")


def flop_ratio(train: dict) -> float:
  """XLA's FLOPs of the compiled step (with the Splash kernel's, from the formula) over
  the model's (model/flops.py, causal attention halved): a train step recomputes, so
  below 1 XLA has not counted every FLOP, and the step time built on it is too short."""
  return (train["cost"]["flops"] + train["cost"]["kernel_flops"]) / \
      train["model_flops_per_chip"]


def _untrusted(train: dict) -> str:
  """Where the estimate cannot be trusted, said in its cell."""
  ratio = flop_ratio(train)
  if ratio < 1:
    return "; **not trusted**: XLA counts fewer FLOPs than the model"
  if ratio > 2:  # E.g. the dropless MoE's worst-case receive buffers, costed in full.
    return f"; **pessimistic**: XLA costs {ratio:.1f}x the model's FLOPs"
  return ""


def markdown(reports: list[dict]) -> str:
  lines = ["| model | topology | per chip (seqs x len) | remat | fits | HBM per chip GiB "
           "(args + temps) of usable | compile wall | tokens/s/chip (ESTIMATE) | MFU "
           "(ESTIMATE) | XLA / model FLOPs | MaxText measured | int8 tokens/s/chip "
           "(ESTIMATE, vs bf16) | quantized, measured elsewhere |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    if "error" in r:
      lines.append(f"| `{r['command'][4]}` | {r['command'][6]} | compile failed: "
                   f"{r['error'].strip().splitlines()[-1][:120]} | | | | | | | | | | |")
    else:
      lines.append(_row_line(r))
  lines += ["", "Commands (each row's `launch.py --mode compile`; JSON in "
            "`runs/pod_table/`). Each", "preset's default remat policy and offload map are "
            "its row's (experiments/configs/pod.py", "`REMAT`, issue 46), so the commands "
            "carry no memory flag but llama2_7b's v5e recipe", "(seq 2048); the figures were "
            "compiled with the same policies given as flags:", ""]
  lines += [f"- `python {' '.join(_shown(r['command']))}`" + (
      f" ({r['wall_s'] / 60:.1f} min wall at load {r['load'][0]:.0f} on this host)"
      if "wall_s" in r else "") for r in reports]
  return "\n".join(lines)


BEGIN, END = "<!-- pod-table: python -m benchmarks.pod_table --docs FILE -->", "<!-- /pod-table -->"


def write_docs(path: str, cache: str) -> None:
  """The cached rows as the table; rows not compiled yet are listed with their commands."""
  done = [r for r in (cached(row, cache) for row in ROWS) if r is not None]
  missing = [row for row in ROWS if cached(row, cache) is None]
  text = markdown(done) if done else "(no row compiled yet)"
  if missing:
    text += ("\n\nNot compiled yet (each is minutes of CPU; run `benchmarks.pod_table` "
             "to add them):\n\n" + "\n".join(
                 f"- `python {' '.join(_shown(command(row, 'x')))}`" for row in missing))
  with open(path) as f:
    page = f.read()
  head, rest = page.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  with open(path, "w") as f:
    f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def _shown(cmd: list[str]) -> list[str]:
  """The command without its --out (a path of this machine)."""
  i = cmd.index("--out")
  return cmd[:i] + cmd[i + 2:]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="pod_table.json")
  parser.add_argument("--cache", default=os.path.join(ROOT, "runs", "pod_table"))
  parser.add_argument("--rows", default="", help="preset@topology[xSLICES],... (default: all ROWS)")
  parser.add_argument("--docs", default="", help="rewrite this page's table (between "
                      f"{BEGIN} and {END}) from the cache; compiles nothing")
  args = parser.parse_args()
  if args.docs:
    write_docs(args.docs, args.cache)
    return
  rows = ROWS
  if args.rows:
    wanted = set(args.rows.split(","))
    rows = tuple(r for r in ROWS if r.key in wanted)
  os.makedirs(args.cache, exist_ok=True)
  reports = [run_row(r, args.cache) for r in rows]
  table = markdown(reports)
  print(table)
  with open(args.out, "w") as f:
    json.dump({"rows": reports, "markdown": table}, f, indent=1)


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  main()
