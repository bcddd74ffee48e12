"""`launch.py --mode generate`: the latest checkpoint of a run continues a prompt."""

from __future__ import annotations

from model import decode


def generate_main(workdir: str, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0) -> str:
  """Prints prompt + continuation and the speed; returns the continuation's text.

  Sampling stops at the tokenizer's EOS (if it has one) or after
  max_new_tokens. The speed counts prefill + decode, not the compile.
  """
  from train import load_run  # pylint: disable=g-import-not-at-top
  run = load_run(workdir)
  ids = run.tokenizer.encode(prompt)
  if not ids:
    raise ValueError(f"prompt={prompt!r}: encodes to no tokens; give --prompt some text")
  (new_ids,), stats = decode.generate_with_stats(
      run.model_config, run.variables, [ids], max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, seed=seed, eos_id=run.tokenizer.eos_id)
  # Decode prompt and continuation together: a character may span the boundary.
  print(run.tokenizer.decode(ids + new_ids))
  seconds = stats["prefill_s"] + stats["decode_s"]
  print(f"{len(new_ids)} tokens in {seconds:.2f} s ({len(new_ids) / seconds:.1f} tokens/s); "
        f"compile {stats['compile_s']:.1f} s, step {run.step}")
  return run.tokenizer.decode(new_ids)
