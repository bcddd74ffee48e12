"""Small corpora in every format `--mode prepare` reads, written by the tests themselves."""

from __future__ import annotations

import gzip
import json
import os

WORDS = ("def", "return", "class", "import", "self", "value", "the", "data", "print",
         "for", "in", "range", "if", "else", "é", "→")


def documents(prefix: str, n: int, words: int = 24) -> list[str]:
  """n distinct deterministic documents (a few with non-ASCII characters)."""
  return [f"{prefix} {i}: " + " ".join(WORDS[(i * 7 + j * j) % len(WORDS)]
                                        for j in range(words)) + "\n" for i in range(n)]


def write_jsonl(path: str, texts: list[str], field: str = "text") -> None:
  lines = "".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts))
  data = lines.encode("utf-8")
  if path.endswith(".gz"):
    data = gzip.compress(data, mtime=0)
  elif path.endswith(".zst"):
    import zstandard  # pylint: disable=g-import-not-at-top
    data = zstandard.ZstdCompressor().compress(data)
  with open(path, "wb") as f:
    f.write(data)


def write_parquet(path: str, texts: list[str]) -> None:
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path,
                 row_group_size=16)


def write_hf_saved(directory: str, texts: list[str]) -> None:
  """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files + state.json."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  os.makedirs(directory)
  table = pa.table({"text": texts})
  names = []
  for k, part in enumerate((table.slice(0, len(texts) // 2), table.slice(len(texts) // 2))):
    names.append(f"data-{k:05d}-of-00002.arrow")
    with pa.OSFile(os.path.join(directory, names[-1]), "wb") as sink:
      with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(part, max_chunksize=10)
  with open(os.path.join(directory, "state.json"), "w") as f:
    json.dump({"_data_files": [{"filename": n} for n in names]}, f)
  with open(os.path.join(directory, "dataset_info.json"), "w") as f:
    json.dump({"features": {"text": {"dtype": "string", "_type": "Value"}}}, f)


def all_formats(root: str) -> dict[str, list[str]]:
  """One corpus directory holding .txt, .jsonl, .jsonl.gz, .jsonl.zst and .parquet
  files, and a saved HF dataset beside it; returns {format: its documents}."""
  out = {"txt": documents("text file", 6), "jsonl": documents("plain jsonl", 40),
         "gz": documents("gzip jsonl", 30), "zst": documents("zstd jsonl", 30),
         "parquet": documents("parquet", 50), "hf": documents("saved dataset", 40)}
  corpus = os.path.join(root, "mixed")
  os.makedirs(os.path.join(corpus, "notes"))
  for i, text in enumerate(out["txt"]):
    with open(os.path.join(corpus, "notes", f"note{i}.txt"), "w", encoding="utf-8") as f:
      f.write(text)
  write_jsonl(os.path.join(corpus, "a.jsonl"), out["jsonl"])
  write_jsonl(os.path.join(corpus, "b.jsonl.gz"), out["gz"])
  write_jsonl(os.path.join(corpus, "c.jsonl.zst"), out["zst"])
  write_parquet(os.path.join(corpus, "d.parquet"), out["parquet"])
  write_hf_saved(os.path.join(root, "hf_saved"), out["hf"])
  return out
