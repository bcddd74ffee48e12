"""`launch.py --mode generate`: the latest checkpoint of a run continues a prompt."""

from __future__ import annotations

from model import decode


def check_prompt(prompt: str) -> None:
  """Every tokenizer encodes UTF-8: refuse text that has none, naming the byte.

  Command-line bytes that are not UTF-8 reach sys.argv as lone surrogates
  (U+DC80..U+DCFF stand for the bytes 0x80..0xFF, PEP 383), which would fail
  deep inside the tokenizer with a UnicodeEncodeError.
  """
  try:
    prompt.encode("utf-8")
  except UnicodeEncodeError as e:
    char = prompt[e.start]
    offset = len(prompt[:e.start].encode("utf-8"))
    what = (f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF
            else f"lone surrogate {char!r}")
    raise ValueError(
        f"--prompt is not valid UTF-8: {what} at byte {offset} (character {e.start}, "
        f"after {prompt[max(0, e.start - 20):e.start]!r}); pass UTF-8 text (check the "
        "terminal's locale or the encoding of the file the prompt came from)") from None


def generate_main(workdir: str, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, step: int | None = None) -> str:
  """Prints prompt + continuation and the speed; returns the continuation's text.

  Sampling stops at the tokenizer's EOS (if it has one) or after
  max_new_tokens. The speed counts prefill + decode, not the compile.
  """
  from train import load_run  # pylint: disable=g-import-not-at-top
  check_prompt(prompt)  # Before loading the run: a bad prompt fails in no time.
  run = load_run(workdir, step=step)
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
