"""Decay branches of a warmup-stable-decay run (Hägele et al. 2024, section 3).

A run with `train.schedule="wsd"` and train.steps = T cools down over its last
decay_fraction * T steps; before that its lr does not depend on T. So the run with
T_b < T steps is, up to its own cooldown start S_b = decay_start(T_b), the same
computation as the longer run's first S_b steps. `branch_run(src, dst, config)`
starts `dst` from `src`'s checkpoint at S_b (the parameters, optimizer and data
iterator state, copied byte for byte) with `config` (src's config with
train.steps = T_b); training `dst` then runs only the cooldown, and equals
training T_b steps from scratch, bitwise (tests/train/test_branch.py).

`dst`'s config.json records `_run.branched_from` (the source run) and
`_run.source_step` (S_b); tokens and FLOPs are counted from the source's start
(its train lines' tokens_seen continue the source's). The source keeps its
checkpoint at S_b when S_b is in its `train.keep_steps` (a sweep sets that:
experiments/sweep/branch.py).
"""

from __future__ import annotations

import os
import shutil

import ml_collections

from train import checkpoint as ckpt
from train.io import checksums, storage
from train.lifecycle import changes, config_record, session
from train.optim import decay_start
from train.spec import RunSpec


def check_branch(src_config: RunSpec, config: RunSpec) -> int:
  """The step the branch starts from; ValueError naming what makes it no branch."""
  for name, c in (("source", src_config), ("branch", config)):
    if c.train.schedule != "wsd":
      raise ValueError(f"a decay branch needs train.schedule='wsd'; the {name} has "
                       f"{c.train.schedule!r}")
  start = decay_start(config.train)
  if start > decay_start(src_config.train):
    raise ValueError(f"the branch (train.steps={config.train.steps}) cools down from step "
                     f"{start}, after the source's own cooldown starts at step "
                     f"{decay_start(src_config.train)}: it must be a shorter budget")
  # As a resume compares (train/lifecycle/resume.py): a field one side leaves unset
  # (e.g. model.vocab_size, resolved from the tokenizer) is no change.
  differ = [c for c in changes.config_changes(dict(src_config.record), dict(config.record))
            if not changes.is_operational(c["field"])
            and c["old"] is not None and c["new"] is not None]
  if differ:
    raise ValueError("a decay branch continues its source's run, so it may change only "
                     "operational fields (train.steps, cadences); it changes "
                     + changes.describe(differ))
  return start


def branch_run(src: str, dst: str, config: ml_collections.ConfigDict) -> dict:
  """Writes `dst` as a run at `src`'s stable-phase checkpoint; returns its `_run` record."""
  if found := config_record.contents(dst):
    if config_record.CONFIG_FILE not in found:  # What a branch's copy cut short leaves.
      raise FileExistsError(f"{dst} holds {'; '.join(found)} but no config.json, as a "
                            f"branch's copy cut short leaves it: remove {dst} and re-run, "
                            "or branch into a new directory")
    raise FileExistsError(f"{dst} already holds a run ({'; '.join(found)}); branch into a "
                          "new directory")
  with session.open_run(config, dst, "branch") as s:  # dst's LOCK: one writer.
    return _branch(src, dst, s.spec)


def _branch(src: str, dst: str, spec: RunSpec) -> dict:
  start = check_branch(config_record.read_spec(src), spec)
  step_dir = storage.join(ckpt.checkpoint_dir(src), str(start))
  if not _finished(step_dir):
    have = sorted(int(d) for d in storage.listdir(ckpt.checkpoint_dir(src)) if d.isdigit())
    raise FileNotFoundError(
        f"{src} has no checkpoint at step {start}, where the branch's cooldown starts "
        f"(checkpoints: {have}); add {start} to the source's train.keep_steps")
  source = {"branched_from": storage.absolute(src), "source_step": start}
  # The source's checkpoint as it is (orbax step directories are self-contained), whole
  # before config.json names it: a copy cut short is refused on resume, never restarted.
  _copy_step(step_dir, storage.join(ckpt.checkpoint_dir(dst), str(start)))
  config_record.write_config(dst, spec, {**config_record.environment(spec), **source})
  return source


def _finished(step_dir: str) -> bool:
  """A whole step: a directory locally (orbax renames it when whole), one with its
  commit marker on a bucket (train/io/checkpoint_store.py)."""
  if not storage.is_url(step_dir):
    return storage.isdir(step_dir)
  return storage.exists(storage.join(step_dir, ckpt.COMMIT_FILE))


def _copy_step(step_dir: str, final: str) -> None:
  """Copies a step byte for byte, so its CHECKSUMS.json stays valid. Locally under a
  temporary name, renamed when whole; on a bucket object by object (server-side), the
  checksums and then the commit markers last: orbax lists a step without its marker as
  unfinished, and `branch_run` refuses the directory a cut-short copy leaves."""
  if storage.is_url(step_dir) != storage.is_url(final):
    raise ValueError(f"a branch copies {step_dir} within its store: {final} is in another "
                     "(put the source run and its branches under one root)")
  if not storage.is_url(final):
    shutil.copytree(step_dir, final + ".partial")
    os.replace(final + ".partial", final)
    return
  rank = lambda rel: (3 if rel == ckpt.COMMIT_FILE else 2 if rel.endswith(ckpt.COMMIT_FILE)
                      else 1 if rel == checksums.CHECKSUMS_FILE else 0, rel)
  storage.copy_tree(step_dir, final, key=rank)
