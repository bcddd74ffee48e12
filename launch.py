"""blockwork's entry point, intentionally kept short: flags -> config -> mode.

  python launch.py                                  # train experiments/configs/tiny.py -> runs/tiny
  python launch.py --config experiments/configs/tiny.py --workdir runs/x --config.train.steps=200
  python launch.py --config experiments/configs/gqa_ablation.py:smoke --workdir runs/gqa --sweep
  python launch.py --mode eval --workdir runs/x [--step N] [--config.eval.x=y]
  python launch.py --mode generate --workdir runs/x --prompt "ROMEO:"
  python launch.py --mode import --hf_dir DIR --workdir runs/imported
  python launch.py --mode export --workdir runs/x --hf_dir DIR   (for transformers)
  python launch.py --mode convert --from_run runs/mha --workdir runs/gqa2 --config.model.num_kv_heads=2
  python launch.py --mode compile --config experiments/configs/pod.py:preset=1b --topology v5p-128
  python launch.py --mode prepare --input 'corpus/*.jsonl.zst' --output prepared/web \
      [--config.data.tokenizer=sentencepiece --config.data.vocab_size=8192]

An error in what you asked for (a config field, a file, a run directory) ends with one
line naming it, `error: ...`, and exit status 1; `--verbosity=1` shows its traceback.

Logging: INFO by default (whether a run starts fresh or resumes, and from which
step); `--verbosity=-1` shows warnings only, `--verbosity=1` adds debug lines and
orbax's per-file messages.
"""

from __future__ import annotations

import time

_STARTED = time.time()  # Before the imports: the run's goodput counts them (train/lifecycle/goodput.py).

import logging  # pylint: disable=g-import-not-at-top,wrong-import-position
import os
import re
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "experiments", "configs", "tiny.py")



def override_error(error: Exception, argv: list[str]) -> str:
  """ml_collections' error for a `--config.x.y=v` naming no field (a KeyError whose text
  is "'step'\nDid you mean \"steps\" ...") as one line naming the flag and the fix."""
  text = str(error)
  hint = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
  key = hint.group(2) if hint else next(iter(re.findall(r"\\?'([\w.-]+)\\?'", text)), None)
  for arg in argv:
    path = arg.partition("=")[0][len("--config."):].split(".")
    if arg.startswith("--config.") and key in path:
      parent = ".".join(["config", *path[:path.index(key)]])
      fix = f"; did you mean {parent}.{hint.group(1)}?" if hint else ""
      return f"{arg}: {parent} has no field {key!r}{fix}"
  return f"a --config override names no field: {' '.join(text.split())}"


def _refuse(message: str) -> None:
  """The one line of every refused input (main_with_messages' format), exit status 1."""
  print(f"error: {message}\n(--verbosity=1 shows the traceback)", file=sys.stderr)
  sys.exit(1)


try:  # Without --config, ml_collections applies the overrides here, at definition.
  config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Experiment config file[:arg].",
                                  lock_config=False)
except (AttributeError, KeyError) as e:
  _refuse(override_error(e, sys.argv))
flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "eval", "generate", "import", "export", "convert",
                                    "prepare", "compile"],
                  "What to do.")
flags.DEFINE_integer("step", None, "--mode eval / generate: the checkpoint step "
                     "(default: the latest that restores).")
flags.DEFINE_string("eval_into", None, "--mode eval: write the evaluation as a run directory "
                    "of its own (a sweep's evaluation point) instead of RUN/evals.jsonl.")
flags.DEFINE_bool("allow_config_change", False,
                  "Resume with a config that differs from the run's config.json in fields "
                  "that change what it computes; each change is recorded with its step.")
flags.DEFINE_bool("sweep", False, "Run every point of the config's sweep(arg).")
flags.DEFINE_integer("sweep_parallel", 1, "Sweep points to run at once, locally.")
flags.DEFINE_enum("sweep_emit", None, ["commands", "slurm"],
                  "Print one launch command per point (or a SLURM array script) instead.")
flags.DEFINE_list("sweep_only", None, "With --sweep / --sweep_emit: only the points whose "
                  "names match these names or globs (rope,alibi or 'kv*-s0'), in the "
                  "sweep's order; sweep.json still records every point.")
flags.DEFINE_string("prompt", "", "Prompt for --mode generate.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_string("hf_dir", None, "Hugging Face model directory: --mode import reads it, "
                    "--mode export writes it.")
flags.DEFINE_string("from_run", None, "--mode convert: the trained run to convert.")
flags.DEFINE_enum("convert_method", "mean", ["mean", "first", "random"],
                  "--mode convert: how each group of K/V heads becomes one (GQA paper).")
flags.DEFINE_list("input", None, "--mode prepare: files, directories, globs, a saved Hugging "
                  "Face dataset or hf:NAME (comma-separated).")
flags.DEFINE_string("output", None, "--mode prepare: the prepared dataset's directory (new).")
flags.DEFINE_string("text_field", "text", "--mode prepare: the JSONL field / Parquet column "
                    "holding the text.")
flags.DEFINE_string("id_field", "", "--mode prepare: a field naming each document (its "
                    "validation hold-out hashes it); default: file and line.")
flags.DEFINE_bool("skip_bad_records", False, "--mode prepare: skip malformed records "
                  "(counted in the manifest) instead of stopping at the first.")
flags.DEFINE_string("tokenizer_from", "", "--mode prepare with data.tokenizer=sentencepiece: "
                    "train the model on a mixture's datasets, each sampled by its weight, "
                    "NAME=INPUT:WEIGHT,... (docs/data.md, 'One tokenizer for a mixture')")
flags.DEFINE_integer("prepare_workers", None, "--mode prepare: tokenizing processes "
                     "(default: cores - 1).")
flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
flags.DEFINE_string("topology", None, "--mode compile: a TPU topology, e.g. v5p:4x4x4 "
                    "or v5e-16 (docs/compile.md).")
flags.DEFINE_integer("num_slices", 1, "--mode compile: slices joined by DCN (multi-slice); "
                     "config.mesh.dcn_* split the mesh across them.")
flags.DEFINE_list("compile_steps", ["train", "eval", "decode"],
                  "--mode compile: which steps to compile.")
flags.DEFINE_bool("roofline", True, "--mode compile: estimate the train step's time and "
                  "MFU (two more small compiles, after the verdict); --noroofline skips it.")
flags.DEFINE_bool("fit", False, "--mode compile: search the largest per-chip batch whose "
                  "train step fits under each remat policy and print the --config flags "
                  "to use (train/aot/fit.py).")
flags.DEFINE_integer("fit_max_per_chip", 256, "--mode compile --fit: the largest per-chip "
                     "batch (sequences) the search tries.")
flags.DEFINE_list("fit_policies", None, "--mode compile --fit: the remat policies to "
                  "search, e.g. full,save_qkv_proj, or all (default: full, save_qkv_proj, "
                  "minimal; searched from full upward, train/aot/fit.py).")
flags.DEFINE_list("fit_stages", [], "--mode compile --fit: pipeline stage counts to search "
                  "too, e.g. 1,2,4 (mesh.stage inside a slice; those the config cannot "
                  "pipeline are refused with the reason; train/aot/fit_stages.py).")
flags.DEFINE_list("fit_microbatches", ["1", "2", "4"], "--mode compile --fit_stages: the "
                  "pipeline microbatches searched, as multiples k of the stage count S "
                  "(M = k * S), those the per-chip batch divides.")
flags.DEFINE_string("out", None, "--mode compile: the JSON report (default: "
                    "runs/compile/<config name>-<topology>-b<batch>-L<seq_len>-<config hash>.json).")
FLAGS = flags.FLAGS


def _config_spec() -> tuple[str, str | None]:
  """(path, arg) of --config PATH[:arg], as config_flags parsed it (its filename keeps the
  `:arg`; it splits at the first colon too), so `--config=`, `--config PATH` and flagfiles
  all agree with the config that was loaded."""
  path, colon, arg = config_flags.get_config_filename(FLAGS["config"]).partition(":")
  return path, (arg if colon else None)


def _overrides() -> list[str]:
  return [a for a in sys.argv[1:] if a.startswith("--config.")]


def _setup_logging() -> None:
  """absl's handler (installed by app.run) prints every record at --verbosity (default
  0: INFO). orbax logs each file it writes through absl at INFO: that stays quiet
  unless --verbosity is 1 (debug) or more."""
  if absl_logging.get_verbosity() < absl_logging.DEBUG:
    for noisy in ("absl", "jax"):  # orbax per-file lines; "no TPU backend" on CPU.
      logging.getLogger(noisy).setLevel(logging.WARNING)


def _eval(workdir: str) -> None:
  from experiments.sweep import parse_flags  # pylint: disable=g-import-not-at-top
  from train.eval.mode import EVALS_FILE, evaluate_run  # pylint: disable=g-import-not-at-top
  from train.lifecycle import config_record  # pylint: disable=g-import-not-at-top
  config = config_record.read_config(workdir)  # Every field: an older run's at its meaning.
  overrides = parse_flags(config, _overrides())
  record = evaluate_run(workdir, FLAGS.step, overrides, into=FLAGS.eval_into)
  figures = {k: v for k, v in record.items()
             if k not in ("step", "split", "overrides", "time")}
  print(f"{workdir} step {record['step']}" +
        (f" with {overrides}" if overrides else "") + ":")
  for key, value in figures.items():
    print(f"  {key:<24} {value:.6g}" if isinstance(value, float) else f"  {key:<24} {value}")
  from train.io import storage  # pylint: disable=g-import-not-at-top
  print(f"recorded in {FLAGS.eval_into or storage.join(workdir, EVALS_FILE)}")


def _convert(workdir: str) -> None:
  if not FLAGS.from_run or not FLAGS.workdir:
    raise app.UsageError("--mode convert needs --from_run SRC and --workdir DST")
  from experiments.sweep import parse_flags  # pylint: disable=g-import-not-at-top
  from train.convert import convert_run  # pylint: disable=g-import-not-at-top
  from train.lifecycle import config_record  # pylint: disable=g-import-not-at-top
  overrides = parse_flags(config_record.read_config(FLAGS.from_run), _overrides())
  source = convert_run(FLAGS.from_run, workdir, overrides, FLAGS.convert_method)
  print(f"converted {FLAGS.from_run} (step {source['source_step']}, "
        f"{source['source_num_kv_heads']} KV heads) into {workdir} by {FLAGS.convert_method}; "
        f"continue it with --config experiments/configs/from_run.py:{workdir} "
        f"--workdir {workdir} --config.train.steps=N")


def _ints(name: str) -> list[int]:
  """A --flag=1,2,4 list of positive ints, or a UsageError naming the flag."""
  try:
    out = [int(v) for v in FLAGS[name].value]
  except ValueError:
    out = []
  if any(v < 1 for v in out) or len(out) != len(FLAGS[name].value):
    raise app.UsageError(f"--{name}={','.join(FLAGS[name].value)}: must be positive "
                         "integers, e.g. 1,2,4")
  return out


def _compile(config) -> None:
  if not FLAGS.topology:
    raise app.UsageError("--mode compile needs --topology, e.g. v5p:4x4x4 or v5e-16")
  from train.aot import compile_for_topology, format_report, libtpu_available, parse_topology
  if not libtpu_available():
    raise app.UsageError("--mode compile needs libtpu, the TPU compiler: pip install -e "
                         "'.[aot]' (or make test-aot); docs/compile.md")
  topo = parse_topology(FLAGS.topology, FLAGS.num_slices)
  from train.aot.report import default_out, write_report  # pylint: disable=g-import-not-at-top
  out = FLAGS.out or default_out(config, topo, FLAGS.fit)
  if FLAGS.fit:
    from train.aot.fit import fit_search, format_fit  # pylint: disable=g-import-not-at-top
    print(f"fit: trials go to {out} as they finish (the same command reuses them)",
          flush=True)
    report = fit_search(config, topo, ceiling=FLAGS.fit_max_per_chip,
                        policies_asked=FLAGS.fit_policies, roofline=FLAGS.roofline, out=out,
                        stages=_ints("fit_stages"), microbatch_factors=_ints("fit_microbatches"))
    print(format_fit(report))
  else:
    report = compile_for_topology(config, topo, steps=tuple(FLAGS.compile_steps),
                                  roofline=FLAGS.roofline)
    print(format_report(report))
  write_report(report, out)
  print(f"figures in {out}")
  if not report["fits"]:
    sys.exit(2)  # Scripts can tell "does not fit" from a compile error (1).


def _config():
  path, _ = _config_spec()
  if not os.path.isfile(path):  # config_flags would say "Failed loading ... config_config".
    raise FileNotFoundError(f"--config {path}: no such config file (configs are in "
                            f"{os.path.relpath(os.path.dirname(DEFAULT_CONFIG))}/)")
  return FLAGS.config


def _prepare(config) -> None:
  if not FLAGS.input or not FLAGS.output:
    raise app.UsageError("--mode prepare needs --input FILES and --output DIR")
  from train.data.prepare import prepare  # pylint: disable=g-import-not-at-top
  d = config.data  # Bad input raises PrepareError, a ValueError: main_with_messages' one line.
  m = prepare(FLAGS.input, FLAGS.output, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
              spm_model=d.spm_model, text_field=FLAGS.text_field, id_field=FLAGS.id_field,
              val_fraction=d.val_fraction, skip_bad_records=FLAGS.skip_bad_records,
              workers=FLAGS.prepare_workers, command=sys.argv,
              tokenizer_from=FLAGS.tokenizer_from)
  splits = ", ".join(f"{k} {v['documents']:,} documents / {v['tokens']:,} tokens"
                     for k, v in m["splits"].items())
  skipped = f"; skipped {m['skipped']}" if m["skipped"] else ""
  print(f"prepared {FLAGS.output} ({m['tokenizer']['fingerprint']}): {splits}{skipped}; "
        f"train on it with --config.data.corpus={FLAGS.output}")


def _generate(config, workdir: str) -> None:
  del config
  from train.generate import generate_main  # pylint: disable=g-import-not-at-top
  generate_main(workdir, FLAGS.prompt, max_new_tokens=FLAGS.max_new_tokens,
                temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                seed=FLAGS.seed, step=FLAGS.step)


def _import(config, workdir: str) -> None:
  del config
  if not FLAGS.hf_dir:
    raise app.UsageError("--mode import needs --hf_dir")
  from interop.hf import import_hf_dir  # pylint: disable=g-import-not-at-top
  import_hf_dir(FLAGS.hf_dir, workdir)
  print(f"imported {FLAGS.hf_dir} into {workdir}")


def _export(config, workdir: str) -> None:
  del config
  if not FLAGS.hf_dir:
    raise app.UsageError("--mode export needs --workdir RUN and --hf_dir OUT")
  if os.path.isdir(FLAGS.hf_dir) and os.listdir(FLAGS.hf_dir):
    # An export never lands on top of other files (a run directory, an earlier export).
    raise app.UsageError(f"--hf_dir {FLAGS.hf_dir} exists and is not empty: export into "
                         "a new directory (or remove it first)")
  from interop.hf import export_hf_dir  # pylint: disable=g-import-not-at-top
  export_hf_dir(workdir, FLAGS.hf_dir)
  print(f"exported {workdir} into {FLAGS.hf_dir} (transformers' from_pretrained loads it)")


def _train(config, workdir: str) -> None:
  """--mode train (the default): the config's sweep with --sweep / --sweep_emit, else one
  run into `workdir`."""
  if FLAGS.sweep or FLAGS.sweep_emit:
    from experiments import sweep  # pylint: disable=g-import-not-at-top
    sweep.main(*_config_spec(), workdir, parallel=FLAGS.sweep_parallel,
               emit=FLAGS.sweep_emit, overrides=_overrides(), only=FLAGS.sweep_only)
    return
  from train.loop import run  # pylint: disable=g-import-not-at-top
  result = run(config, workdir, allow_config_change=FLAGS.allow_config_change)
  if result.preempted:
    print(f"preempted at step {result.step}; checkpoint saved. Re-run the same "
          "command to resume.")
    return
  if result.already_finished:
    print(f"{workdir} is at step {result.step} >= train.steps={config.train.steps}: "
          f"nothing to train, the run is unchanged; logs in "
          f"{workdir}/metrics.jsonl")
    return
  figures = result.eval
  print(f"eval loss {figures['loss']:.4f}  bits/byte {figures['bpb']:.4f}  "
        f"ppl {figures['ppl']:.2f}")
  from train.io import storage  # pylint: disable=g-import-not-at-top
  logs = storage.join(workdir, "metrics.jsonl")
  if config.train.tensorboard:  # Named only where it was written.
    logs += f" and {storage.join(workdir, 'tensorboard')}"
  print(f"logs: {logs}; checkpoints: {storage.join(workdir, 'checkpoints')}")


# --mode NAME -> what it does, given (config, workdir). Each imports what it needs when it
# runs: after maybe_initialize_distributed, and only the mode's own dependencies.
MODES = {
    "train": _train,
    "eval": lambda config, workdir: _eval(workdir),
    "generate": _generate,
    "import": _import,
    "export": _export,
    "convert": lambda config, workdir: _convert(workdir),
    "prepare": lambda config, workdir: _prepare(config),
    "compile": lambda config, workdir: _compile(config),
}


def main(argv):
  del argv
  from train.lifecycle.signals import die_with_parent  # pylint: disable=g-import-not-at-top
  die_with_parent()  # A --sweep_parallel point: ends (saving) with its sweep, never orphaned.
  _setup_logging()
  config = _config()
  from parallel import maybe_initialize_distributed  # Before any other JAX call.
  maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                               FLAGS.process_id)
  workdir = FLAGS.workdir or os.path.join("runs", config.get("name", "run"))
  MODES[FLAGS.mode](config, workdir)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a `--config.x=v` that names no field as one line (with
  --config given, ml_collections applies the overrides here) instead of a traceback."""
  try:
    return FLAGS(argv)
  except (AttributeError, KeyError) as e:
    _refuse(override_error(e, argv))
  except flags.Error as e:  # absl would print its text: a config file's whole traceback.
    _refuse(config_file_error(str(e)))


def config_file_error(text: str) -> str:
  """absl's flag error as one line: for `--config FILE:ARG` whose get_config raised
  (`tiny.py:smok`, `smoke=flase`), the flag and that exception's own message."""
  flag = re.match(r"flag (--config=\S+): Error", text)
  if flag and "Traceback" in text:
    last = [l.strip() for l in text.splitlines() if l.strip()][-1]
    message = re.sub(r"^[\w.]*(Error|Exception): ", "", last)
    return f"{flag.group(1)}: {message}"
  return " ".join(text.split())


def main_with_messages(argv, run_main=None):
  """`main` (or `run_main`), with an error in the user's input (a config field, a file, a
  run directory, a lock, a non-finite loss, a mode's missing flag) printed as its one-line
  message instead of a traceback (or absl's whole --help before a UsageError)."""
  from train.lifecycle.lock import LockError  # pylint: disable=g-import-not-at-top
  try:
    (run_main or main)(argv)
  except (ValueError, OSError, LockError, FloatingPointError, app.UsageError) as e:
    if absl_logging.get_verbosity() >= absl_logging.DEBUG:
      raise
    _refuse(str(e))


if __name__ == "__main__":
  from train.hostenv import (  # pylint: disable=g-import-not-at-top
      mark_process_start, quiet_backend_default, reexec_with_malloc_tuning)
  mark_process_start(_STARTED)  # Kept through the re-exec below (same pid).
  quiet_backend_default()  # No libtpu start-up noise on a host without an accelerator.
  reexec_with_malloc_tuning()  # glibc reads it at start-up: before anything runs.
  app.run(main_with_messages, flags_parser=parse_flags)
