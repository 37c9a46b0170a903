"""Benchmark the data path of a language model: preparing a corpus, reading it, and what a run's
memory does as the corpus grows.

    python scripts/bench_data.py                        # ~5 min on 2 cores
    python scripts/bench_data.py --big-mb 30 --quick    # small (the test's)
    python scripts/bench_data.py --json data.json

Corpora are JSON lines made of the text files on this machine (this repository's and Python's
own sources, repeated to size): ``--small-mb`` and ``--big-mb`` of text. Three parts, one at a
time, nothing else of this script running beside them:

- ``prepare``: ``python -m bundle.data prepare`` of a ``--prepare-mb`` corpus, byte-level and
  with ``--tokenizer DIR`` where given, with ``--workers 1`` and ``--workers 2``: MB/s and
  tokens/s of each (a fresh output each time; the seconds include the command's start-up);
- ``loader``: the training split read as a stage-0 replica reads it (``--dataset tokens``, the
  order of ``--seed``, batches of ``--batch-size`` windows of ``--seq-len`` tokens, through the
  read-ahead thread): tokens/s, against what the small GPT consumes in ``main.py`` at shape 1,1
  (samples/s x seq-len from its summary): ``loader_vs_training`` > 1 means data never waits;
- ``memory``: the same ``main.py`` run on the small and on the big corpus: ``peak_rss_mib`` (the
  largest over the job's processes) and ``data_wait_s`` of each; the difference should be a few
  MB, not the corpus (it is mapped, never read into a process).

The report, with the machine's conditions (CPUs, load), is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bundle.launch.localworld import free_port  # noqa: E402

GPT = ["--model", "gpt", "--model-args", "layers=2,width=64,heads=2"]


def make_corpus(path: Path, megabytes: float) -> int:
    """JSON lines of text files found here, repeated until ``megabytes`` MB: documents written."""
    sources = sorted(REPO.rglob("*.py")) + sorted(REPO.rglob("*.md"))
    sources += sorted(Path(os.__file__).parent.glob("*.py"))
    texts = [p.read_text(errors="replace") for p in sources if p.is_file()]
    want, size, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w") as f:
        while size < want:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size, docs = size + len(line), docs + 1
                if size >= want:
                    break
    return docs


def prepare(corpus: Path, out: Path, workers: int, tokenizer: str | None = None) -> dict:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "bundle.data", "prepare", str(corpus), "--out", str(out)]
    cmd += ["--workers", str(workers), *(["--tokenizer", tokenizer] if tokenizer else [])]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    index = json.loads((out / "index.json").read_text())
    tokens = sum(s["tokens"] for s in index["splits"].values())
    mb = corpus.stat().st_size / 1e6
    return {
        "tokenizer": tokenizer or "bytes",
        "workers": workers,
        "seconds": round(seconds, 2),
        "mb_per_s": round(mb / seconds, 2),
        "tokens_per_s": round(tokens / seconds),
    }


def loader_rate(corpus_dir: Path, seq_len: int, batch: int, batches: int) -> float:
    """Tokens/s of the training split read as stage 0 reads it, through the read-ahead thread."""
    from bundle.config import DataConfig
    from bundle.data import loader, order, tokens

    cfg = DataConfig(dataset="tokens", data_dir=str(corpus_dir), seq_len=seq_len)
    train = tokens.windows(cfg, "train")
    shard = order.Shard(num_bundles=1, micro_batches=1, width=1, bundle=0, replica=0)
    keys = order.replica_indices(shard, len(train), batch, 0, batches, lazy=True)
    t0 = time.perf_counter()
    for _x, _y in loader.micro_batches(train, keys, workers=0):
        pass
    return batches * batch * seq_len / (time.perf_counter() - t0)


def train(corpus_dir: Path, seq_len: int, batch: int, steps: int) -> dict:
    cmd = [sys.executable, str(REPO / "main.py"), *GPT, "--dataset", "tokens"]
    cmd += ["--data-dir", str(corpus_dir), "--seq-len", str(seq_len), "--batch-size", str(batch)]
    cmd += ["--itr", str(steps), "--no-eval", "--log-every", str(steps), "--portNum"]
    cmd += [str(free_port())]
    out = subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: summary[k] for k in ("samples_per_s", "peak_rss_mib", "data_wait_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--small-mb", type=float, default=3.0)
    p.add_argument("--big-mb", type=float, default=300.0)
    p.add_argument("--prepare-mb", type=float, default=50.0)
    p.add_argument("--tokenizer", help="also prepare with this tokenizer (a directory)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=60, help="main.py steps of each memory run")
    p.add_argument("--quick", action="store_true", help="prepare with --workers 1 only")
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    report: dict = {
        "command": " ".join(["python scripts/bench_data.py", *(argv or sys.argv[1:])]),
        "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpora = {}
        for name, mb in (("small", a.small_mb), ("big", a.big_mb)):
            make_corpus(root / f"{name}.jsonl", mb)
            corpora[name] = root / f"{name}.tokens"
        make_corpus(root / "prepare.jsonl", a.prepare_mb)
        workers = (1, 2)[: 1 + (not a.quick)]
        report["prepare"] = [
            prepare(root / "prepare.jsonl", root / f"p-{i}-{w}.tokens", w, tok)
            for i, tok in enumerate([None, a.tokenizer] if a.tokenizer else [None])
            for w in workers
        ]
        for name in corpora:
            prepare(root / f"{name}.jsonl", corpora[name], 2)
        read = loader_rate(corpora["big"], a.seq_len, a.batch_size, 200)
        runs = {
            name: train(path, a.seq_len, a.batch_size, a.steps) for name, path in corpora.items()
        }
    consumed = runs["small"]["samples_per_s"] * a.seq_len
    report["loader"] = {
        "tokens_per_s": round(read),
        "training_tokens_per_s": round(consumed),
        "loader_vs_training": round(read / consumed, 1),
    }
    report["memory"] = {
        **{f"{name}_mb": mb for name, mb in (("small", a.small_mb), ("big", a.big_mb))},
        **{name: run for name, run in runs.items()},
        "peak_rss_mib_difference": round(
            runs["big"]["peak_rss_mib"] - runs["small"]["peak_rss_mib"], 1
        ),
    }
    report["load_after"] = round(os.getloadavg()[0], 2)
    text = json.dumps(report)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
