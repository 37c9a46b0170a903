"""Real corpora end to end: a corpus prepared into token shards (``--dataset tokens``), and the
same pages as JSON lines and Parquet streamed (``--dataset hf``), train a GPT with AdamW at shape
2,1 x 2 bundles, saved after step 3 and resumed: bit-identical at the same shape, and within the
reshape tests' tolerance (only the order of floating-point sums differs, never a sample) at
1,1,1 x 1 bundle. The stream resumes from the position its checkpoint recorded."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
import torch

from bundle import data
from bundle.checkpoint import format as ckpt
from bundle.config import CheckpointConfig, RunConfig
from bundle.data.__main__ import main as data_command
from bundle.launch.localworld import run_world
from bundle.session import build_session, make_checkpointer, train_stream
from bundle.topology import Topology
from bundle.trainer import data_position
from tests.support.reference import TOL, equivalence_config

pytestmark = pytest.mark.slow

SAVED_AT, STEPS = 3, 6
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The project's own docs, prepared byte-level (a few hundred KB, a handful of shards)."""
    out = tmp_path_factory.mktemp("corpus") / "tokens"
    pages = sorted(str(p) for p in (ROOT / "docs").glob("*.md"))
    assert data_command(["prepare", *pages, "--out", str(out), "--shard-tokens", "50000"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> str:
    """The same pages' paragraphs, a document each, as .jsonl, .jsonl.gz and .parquet files: the
    first three hold two each, so the run crosses from file to file."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    out = tmp_path_factory.mktemp("jsonl")
    pages = sorted((ROOT / "docs").glob("*.md"))
    docs = [p for page in pages for p in page.read_text().split("\n\n") if p.strip()]
    lines = [json.dumps({"text": d, "words": len(d.split())}) + "\n" for d in docs]
    (out / "a.jsonl").write_text("".join(lines[:2]))
    with gzip.open(out / "b.jsonl.gz", "wt") as f:
        f.write("".join(lines[2:4]))
    pq.write_table(pa.table({"text": docs[4:6]}), out / "c.parquet")
    (out / "d.jsonl").write_text("".join(lines[6:]))
    return f"{out}/*.jsonl*,{out}/*.parquet"


def _cfg(corpus: str, shape, bundles: int, save_dir: str, dataset: str = "tokens") -> RunConfig:
    where = {"data_files": corpus} if dataset == "hf" else {"data_dir": corpus}
    cfg = equivalence_config(
        shape,
        bundles,
        "1f1b",
        3,
        "flat",
        "gpt",
        sections={
            "model": {"name": "gpt", "args": "layers=2,width=16,heads=2"},
            "data": {"dataset": dataset, **where, "seq_len": 8},
            "train": {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1, "steps": STEPS},
        },
    )
    return dataclasses.replace(cfg, checkpoint=CheckpointConfig(save_dir=save_dir))


def _run(rank: int, world: int, cfg: RunConfig, resume: str | None, save_at: int | None):
    """Train from ``resume`` (None: from the start) to the end, saving after ``save_at``."""
    topo = Topology.from_config(cfg)
    session = build_session(cfg, topo, rank, torch.device("cpu"))
    saver = make_checkpointer(cfg, topo, rank, session)  # a stream's position recorded too
    start = saver.restore(resume)
    batches = train_stream(
        session, topo, cfg.train.seed, STEPS, 0, start=start, position=data_position(resume)
    )
    for step in range(start, STEPS):
        session.engine.train_step(step, next(batches))
        if step + 1 == save_at:
            saver.save(save_at)
    stage = session.stage
    final = {stage.full_name(n): p.detach().clone() for n, p in stage.named_parameters()}
    return saver.last_saved, final


def _merged(results) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for _, final in results:
        out.update(final)
    return out


# Saved at 1,1 x 2 bundles (4 processes); resumed there, and as one process (shape 1, 1 bundle).
SAVED, OTHER = ((1, 1), 2), ((1,), 1)


def _resumes(cfg_at) -> str:
    """Train at SAVED, saving after SAVED_AT; resume at SAVED (bit-identical) and at OTHER
    (within TOL). Returns the checkpoint."""
    whole = run_world(4, _run, cfg_at(*SAVED), None, SAVED_AT)
    path = whole[0][0]
    assert path.endswith(f"step-{SAVED_AT}")
    want = _merged(whole)
    again = _merged(run_world(4, _run, cfg_at(*SAVED), path, None))
    assert set(again) == set(want)
    for name, value in again.items():
        assert torch.equal(value, want[name]), f"{name}: not bit-identical after resuming"
    other = _merged(run_world(1, _run, cfg_at(*OTHER), path, None))
    assert set(other) == set(want)
    for name, value in other.items():
        err = (value - want[name]).abs().max().item()
        assert err <= TOL, f"{name} off by {err:.2e} resumed as one process"
    return path


def test_a_prepared_corpus_resumes_exactly_and_under_another_shape(corpus, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    path = _resumes(lambda shape, bundles: _cfg(corpus, shape, bundles, save_dir))
    cfg = _cfg(corpus, *SAVED, save_dir)
    assert ckpt.read_info(path)["corpus"] == data.identity(cfg.data)["corpus"]


def test_a_stream_of_json_lines_and_parquet_resumes_exactly_and_under_another_shape(
    jsonl, tmp_path
):
    save_dir = str(tmp_path / "ckpt")
    path = _resumes(lambda shape, bundles: _cfg(jsonl, shape, bundles, save_dir, "hf"))
    position = ckpt.read_info(path)["data_position"]
    assert position["window"] == SAVED_AT * _cfg(jsonl, *SAVED, save_dir, "hf").train.batch_size
    assert position["file"] > 0  # past the first file: the resumed run opens another at a row
