"""lm-evaluation-harness tasks on a blockwork run, through launch.py as a user runs them:
in the training loop, by `--mode eval`, and against the harness's own Hugging Face
backend on the run exported by `--mode export`.

One smoke run (2 steps, a local multiple-choice task, a generation task and passkey
evaluated in the loop at each step) serves every test."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from model import Transformer  # noqa: E402
from tests.cli import launch  # noqa: E402
from tests.train.eval.local_tasks import MC_DOCS, write_tasks  # noqa: E402
from train import load_run  # noqa: E402
from train.eval import tasks  # noqa: E402
from train.eval.harness import BlockworkLM, cut_at_stops  # noqa: E402

TASKS = "bw_mc,bw_gen,passkey"
# Passkey at 4 lengths would compile 4 buckets: two (L=32 is shorter than a needle).
RETRIEVAL = ("--config.eval.retrieval_lengths=(4,8)", "--config.eval.retrieval_depths=(0,1)",
             "--config.eval.retrieval_samples=1", "--config.eval.retrieval_candidates=3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("harness")
  task_dir = write_tasks(str(root / "tasks"))
  d = str(root / "run")
  launch("--workdir", d, "--config.train.steps=2", "--config.train.async_checkpoint=False",
         "--config.train.tensorboard=False", "--config.train.checkpoint_every=2",
         "--config.train.eval_every=1", "--config.model.max_seq_len=256",
         f"--config.eval.tasks={TASKS}", f"--config.eval.task_dir={task_dir}",
         "--config.eval.task_batch_size=8", *RETRIEVAL)
  return d, task_dir


def _requests(kind, args):
  return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@functools.partial(jax.jit, static_argnums=0)
def _logp(cfg, variables, ids_BL):
  logits = Transformer(cfg).apply(variables, ids_BL)
  return jax.nn.log_softmax(logits.astype(jnp.float32), -1)


def _direct_logprob(r, ids, n):
  """Sum of the last n token log-probs of `ids`, straight from Transformer.apply (padded
  on the right to 256 + 1, which a causal model never sees: one compile)."""
  padded = np.zeros(257, np.int32)
  padded[:len(ids)] = ids
  logp = np.asarray(_logp(r.model_config, r.variables, padded[None, :-1]))[0]
  return float(sum(logp[t - 1, ids[t]] for t in range(len(ids) - n, len(ids))))


def test_tasks_are_logged_at_each_eval_step_of_training(run):
  d, _ = run
  evals = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))
           if json.loads(l).get("split") == "eval"]
  assert [e["step"] for e in evals] == [1, 2]
  for e in evals:
    assert e["bw_mc/n"] == MC_DOCS and 0 <= e["bw_mc/acc"] <= 1
    assert e["bw_gen/n"] == 4 and "bw_gen/exact_match" in e
    assert {"passkey/exact@128", "passkey/rank@256", "passkey/exact@256/depth100"} <= set(e)
    assert 1 <= e["passkey/rank@128"] <= 3


def test_adapter_loglikelihoods_equal_the_models_token_logprobs(run):
  r = load_run(run[0])
  # One bucket (every row padded to 256): one compile.
  lm = BlockworkLM(r.model_config, r.variables, r.tokenizer, batch_size=4, min_bucket=256)
  pairs = [("ROMEO: ", "What light"), ("a", "b"), ("", "JULIET"), ("x" * 300, " tail")]
  got = lm.loglikelihood(_requests("loglikelihood", pairs))
  for (ctx, cont), (logp, _) in zip(pairs, got):
    ctx, cont = (ctx.rstrip(), ctx[len(ctx.rstrip()):] + cont)  # The HF backend's split.
    ids = list((ctx + cont).encode())[-257:]  # Left-truncated to max_seq_len + 1.
    n = len(cont.encode()) - (0 if ctx else 1)  # No BOS: an empty context's 1st token.
    assert logp == pytest.approx(_direct_logprob(r, ids, n), abs=1e-4), (ctx[:9], cont)
  text = "O Romeo, Romeo! wherefore art thou Romeo?"
  (rolled,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
  ids = list(text.encode())
  assert rolled == pytest.approx(_direct_logprob(r, ids, len(ids) - 1), abs=1e-4)


def test_generate_until_is_the_greedy_decode_cut_at_the_stop(run):
  from train.generate import generate  # pylint: disable=g-import-not-at-top
  r = load_run(run[0])
  # Batch 1, prompts padded to a multiple of 1: the shapes of the direct call (one compile).
  lm = BlockworkLM(r.model_config, r.variables, r.tokenizer, batch_size=1, min_bucket=1)
  prompt = "ROMEO: "
  (ids,) = generate(r.model_config, r.variables, [list(prompt.encode())], 12)
  text = bytes(ids).decode("utf-8", "replace")
  stop = text[5:7] if len(text) > 7 else "\n"
  (out,) = lm.generate_until(_requests("generate_until",
                                       [(prompt, {"until": [stop], "max_gen_toks": 12})]))
  assert out == cut_at_stops(text, (stop,)) and stop not in out


def test_mode_eval_records_tasks_in_evals_jsonl_and_leaves_the_run_alone(run):
  d, task_dir = run
  before = open(os.path.join(d, "metrics.jsonl")).read()
  ckpts = sorted(os.listdir(os.path.join(d, "checkpoints")))
  out = launch("--mode", "eval", "--workdir", d, "--config.eval.tasks=bw_mc",
               f"--config.eval.task_dir={task_dir}", "--config.eval.num_fewshot=1")
  assert "bw_mc/acc" in out
  (record,) = [json.loads(l) for l in open(os.path.join(d, "evals.jsonl"))]
  assert record["overrides"]["eval.tasks"] == "bw_mc" and record["bw_mc/n"] == MC_DOCS
  assert "passkey/exact@128" not in record
  assert open(os.path.join(d, "metrics.jsonl")).read() == before
  assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ckpts


def test_hf_backend_on_the_exported_run_gives_the_same_loglikelihoods(run, tmp_path):
  from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top
  d, task_dir = run
  hf_dir = str(tmp_path / "hf")
  launch("--mode", "export", "--workdir", d, "--hf_dir", hf_dir)
  r = load_run(d)
  ours = BlockworkLM(r.model_config, r.variables, r.tokenizer, batch_size=8, min_bucket=16)
  # The byte tokenizer has no BOS/EOS: the hf backend wants a prefix id all the same
  # (for empty contexts, which bw_mc has none of).
  theirs = HFLM(pretrained=hf_dir, device="cpu", batch_size=8, dtype="float32",
                prefix_token_id=0)
  manager, = (tasks.check_tasks(["bw_mc"], task_dir)[2],)
  (task,) = tasks.load_harness_tasks(["bw_mc"], manager)["bw_mc"]["tasks"].values()
  task.build_all_requests(rank=0, world_size=1)
  requests = task.instances
  assert len(requests) == 3 * MC_DOCS
  a = np.array([lp for lp, _ in ours.loglikelihood(requests)])
  b = np.array([lp for lp, _ in theirs.loglikelihood(requests)])
  np.testing.assert_allclose(a, b, atol=1e-4)
  accuracy = {}
  for name, lm in (("ours", ours), ("hf", theirs)):
    loaded = tasks.load_harness_tasks(["bw_mc"], manager)
    accuracy[name] = tasks.run_harness(lm, loaded, 0, None)["bw_mc/acc"]
  assert accuracy["ours"] == accuracy["hf"]


def test_unknown_task_and_unreadable_dataset_are_named(run, tmp_path):
  d, task_dir = run
  with pytest.raises(ValueError, match=r"unknown task 'bw_mcq'.*passkey, multi_needle.*"
                     r"bw_gen, bw_mc.*closest: bw_mc"):
    launch("--mode", "eval", "--workdir", d, "--config.eval.tasks=bw_mcq",
           f"--config.eval.task_dir={task_dir}")
  broken = tmp_path / "broken"
  write_tasks(str(broken))
  os.remove(broken / "mc.jsonl")
  with pytest.raises(ValueError, match=r"task 'bw_mc': its dataset cannot be loaded"):
    launch("--mode", "eval", "--workdir", d, "--config.eval.tasks=bw_mc",
           f"--config.eval.task_dir={broken}")


def test_an_evaluation_point_scores_retrieval_under_its_zero_shot_scaling(run, tmp_path):
  from train.eval.mode import evaluate_run  # pylint: disable=g-import-not-at-top
  d, _ = run
  into = str(tmp_path / "rope-yarn")
  overrides = {"eval.tasks": "passkey", "eval.rope_scaling": "yarn",
               "eval.rope_scaling_factor": 8.0, "eval.retrieval_lengths": (8,),
               "eval.retrieval_depths": (0, 1), "eval.retrieval_samples": 1,
               "eval.retrieval_candidates": 3, "eval.task_batch_size": 8}
  record = evaluate_run(d, None, overrides, into=into)
  (line,) = [json.loads(l) for l in open(os.path.join(into, "metrics.jsonl"))]
  trained = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))][-1]
  assert line["passkey/logp@256"] == record["passkey/logp@256"]
  # Positions past the training length (32) are rescaled: another model, other scores.
  assert line["passkey/logp@256"] != pytest.approx(trained["passkey/logp@256"], abs=1e-6)
