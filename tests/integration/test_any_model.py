"""Any model, exact: users' models (an nn.Sequential; a module whose skip connection and integer
side input cross stage boundaries, with a loss of the user's), torchvision models of three
structures (MobileNetV3, DenseNet, also with recompute, ViT) cut by their graph, the GPT
language model on byte-level text, a forward with keyword arguments returning a dict, and Hugging
Face models captured by torch.export (GPT-2 cut across its tied embedding and head, Llama), each
trained by the hybrid at shapes 2,1 x 2 bundles and 1,2,1 under both schedules: the first step's summed gradient must be the one process's gradient of the unsplit
model (1e-5), and after 3 steps of SGD every parameter must be where that process's is (1e-5).

With AdamW only the gradient is compared: Adam divides each gradient by its own running
magnitude, so an element whose gradient is near zero (near ``eps``) turns a roundoff of the
summation order into a visible step; the parameters of AdamW runs are compared bit for bit
against the same run resumed, in test_resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bundle.launch.localworld import run_world
from bundle.session import build_session, train_stream
from bundle.topology import Topology
from tests.support.reference import STEPS, TOL, equivalence_config, reference

pytestmark = pytest.mark.slow

USER = "tests.support.user_models"
# name -> (model section, data section, train section, split points per stage count)
CASES = {
    "sequential+user-loss": (
        {"name": f"{USER}:sequential", "loss": f"{USER}:mean_squared_logits"},
        {},
        {},
        {},
    ),
    "skip-connection": (
        {"name": f"{USER}:skip_net"},
        {},
        {},
        {2: "body.1", 3: "body.0,body.2"},
    ),
    "mobilenet_v3": ({"name": f"{USER}:mobilenet"}, {"image_size": 8}, {}, {}),
    "densenet": ({"name": f"{USER}:densenet"}, {"image_size": 8}, {}, {}),
    # recompute: each stage's blocks run again in backward, multi-tensor boundaries and all
    "densenet+recompute": ({"name": f"{USER}:densenet"}, {"image_size": 8}, {}, {}),
    "vit": ({"name": f"{USER}:vit"}, {"image_size": 8}, {}, {}),
    "gpt": (
        {"name": "gpt", "args": "layers=3,width=16,heads=2"},
        {"dataset": "text", "seq_len": 8},
        {},
        {},
    ),
    "keywords+dict-output": ({"name": f"{USER}:keyword_net"}, {}, {}, {}),
    # Hugging Face models, captured by torch.export: GPT-2 cut across its tied embedding and
    # head (their gradients summed between the stages), Llama's rotary table recomputed.
    "hf-gpt2-tied": ({"name": f"{USER}:gpt2"}, {"dataset": "text", "seq_len": 8}, {}, {}),
    "hf-llama": ({"name": f"{USER}:llama"}, {"dataset": "text", "seq_len": 8}, {}, {}),
    "gpt+adamw": (
        {"name": "gpt", "args": "layers=3,width=16,heads=2"},
        {"dataset": "text", "seq_len": 8},
        {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1, "no_decay_norm_bias": True},
        {},
    ),
}


# Cases run at one of the two shapes only (each world is costly).
ONLY_AT = {"keywords+dict-output": (2, 1), "hf-llama": (1, 2, 1)}


def first_grads(session) -> dict[str, torch.Tensor]:
    """The summed gradient the optimizer sees at the first step, by full-model name."""
    names = {p: session.stage.full_name(n) for n, p in session.stage.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def hook(optimizer, args, kwargs) -> None:
        if not seen:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    seen[names[p]] = p.grad.detach().clone()

    session.optimizer.register_step_pre_hook(hook)
    return seen


def case_config(name: str, shape, bundles: int, schedule: str, text: str):
    model, data, train, points = CASES[name]
    if points.get(len(shape)):
        model = {**model, "partition": points[len(shape)]}
    if data.get("dataset") == "text":
        data = {**data, "data_file": text}
    sync = "hierarchical" if schedule == "gpipe" else "flat"
    sections = {"model": model, "data": data, "train": train}
    recompute = "always" if "recompute" in name else "never"
    return equivalence_config(
        shape, bundles, schedule, 3, sync, "mlp", "fp32", recompute, sections=sections
    )


def _hybrid(rank: int, world: int, shape, bundles: int, text: str) -> list[str]:
    failures = []
    for name in CASES:
        if ONLY_AT.get(name, tuple(shape)) != tuple(shape):
            continue
        refs = None
        for schedule in ("gpipe", "1f1b"):
            cfg = case_config(name, shape, bundles, schedule, text)
            topo = Topology.from_config(cfg)
            session = build_session(cfg, topo, rank, torch.device("cpu"))
            grads = first_grads(session)
            batches = train_stream(session, topo, cfg.train.seed, STEPS, 0)
            for step in range(STEPS):
                session.engine.train_step(step, next(batches))
            mine = {k: v.detach() for k, v in session.stage.full_state_dict().items()}
            crossing = len(session.engine.transport.out_meta)
            gathered = [None] * world if rank == 0 else None
            dist.gather_object((topo.coord(rank), mine, grads, crossing), gathered, dst=0)
            if rank != 0:
                continue
            if refs is None:
                ref_grads: dict[str, torch.Tensor] = {}
                refs = (reference(cfg, 0), reference(cfg, grads=ref_grads), ref_grads)
            init, ref, ref_grads = refs
            moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
            if moved < 1e3 * TOL:
                failures.append(f"{name}: training hardly moved the parameters ({moved:.1e})")
            covered = _compare(name, schedule, gathered, ref, ref_grads, failures)
            if covered != set(ref_grads):
                failures.append(f"{name}: not covered: {sorted(set(ref_grads) - covered)[:3]}")
            if name == "skip-connection" and max(c for *_, c in gathered) < 3:
                failures.append(f"{name}: the skip and the bucket did not cross a boundary")
    return failures


def _compare(name, schedule, gathered, ref, ref_grads, failures: list[str]) -> set[str]:
    """Every rank's first gradient (and, without Adam, its parameters) against one process's;
    returns the parameter names the ranks covered."""
    covered: set[str] = set()
    compare = ["gradient"] + ([] if "adam" in name else ["parameters"])
    for coord, params, got_grads, _ in gathered:
        covered |= set(got_grads)
        for what in compare:
            got, want = (got_grads, ref_grads) if what == "gradient" else (params, ref)
            for key, value in got.items():
                err = (value - want[key]).abs().max().item() if key in want else 0.0
                if err > TOL:
                    failures.append(f"{name} {schedule} {coord}: {what} of {key} off by {err:.2e}")
    return covered


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    source = Path(torch.__file__).with_name("functional.py").read_text()
    path.write_text(source[:20000])
    return str(path)


@pytest.mark.parametrize("shape,bundles", [((2, 1), 2), ((1, 2, 1), 1)], ids=["2,1x2", "1,2,1"])
def test_user_zoo_and_gpt_models_equal_one_process(shape, bundles, text):
    results = run_world(sum(shape) * bundles, _hybrid, shape, bundles, text)
    assert results[0] == [], "\n".join(results[0])
