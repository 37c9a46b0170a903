"""A LoRA run's step out of Bundle: one ``main.py`` run trains adapters on a tiny GPT-2 (its
``Conv1D`` layers, PEFT's ``fan_in_fan_out``) at shape 2,1 with ``ln_f`` trained whole, and its
step is exported three ways. ``--peft``: ``PeftModel.from_pretrained`` on the base built with the
run's seed loads it with no key missing or unexpected and computes the logits of Bundle's merged
model (within 1e-5); ``--hf``: the merged model, whose logits are PEFT's ``merge_and_unload()``'s;
``OUT.pt``: the plain model's state, no adapter in it. ``bundle.generate`` samples the save
directory as it samples the ``--hf`` export. A base that differs from the one trained on is
refused, and so is ``--peft`` of a run without ``--lora``, each in one line. A tiny Llama's LoRA
step exports with ``--hf`` too (its rotary table, a buffer its state dict leaves out, is in the
step and not in the export), as PEFT merges it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bundle import generate, models
from bundle.checkpoint import format as ckpt
from bundle.checkpoint.__main__ import main as export_command
from bundle.config import parse_model_args
from tests.support.processes import finish, start

ROOT = Path(__file__).resolve().parents[2]
GPT2 = "n_layer=2,n_embd=16,n_head=2,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0"
SEED, SEQ, STEPS = 3, 16, 3
LORA = "r=4,alpha=8,targets=c_attn,c_proj"
TOL = 1e-5


def _base() -> torch.nn.Module:
    """The frozen base as the run builds it: the same seed, model and arguments."""
    torch.manual_seed(SEED)
    return models.build(
        "transformers:GPT2LMHeadModel",
        num_classes=256,
        input_shape=(SEQ,),
        args=parse_model_args(GPT2),
    ).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, SEQ), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model(_ids()).logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """One LoRA run of main.py and its step exported as --peft, --hf and OUT.pt."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora-export")
    save_dir = str(root / "ckpt")
    p = start(
        "main.py",
        *("--bundle-shape", "1,2", "--model", "transformers:GPT2LMHeadModel"),
        *("--model-args", GPT2, "--dataset", "text", "--data-file", "docs/checkpoints.md"),
        *("--seq-len", str(SEQ), "--batch-size", "8", "--itr", str(STEPS), "--no-eval"),
        *("--optimizer", "adamw", "--lr", "0.01", "--seed", str(SEED)),
        *("--lora", LORA, "--lora-train", "ln_f", "--save-dir", save_dir),
    )
    rc, out, err = finish(p, timeout=300)
    assert rc == 0, err[-3000:]
    # The summary: what trains, of the whole model, and what the rear's two replicas synced (the
    # gradients of what trains there, once a step; the frozen base's are none of it).
    summary = json.loads(out.strip().splitlines()[-1])
    assert 0 < summary["trainable_params"] < summary["all_params"] / 10, summary
    assert 0 < summary["grad_sync_bytes"] == summary["grad_bytes"], summary
    assert summary["grad_bytes"] < summary["param_bytes"] / 4, summary  # full: equal
    paths = {"save_dir": save_dir, "step": ckpt.step_dir(save_dir, STEPS)}
    for kind, argv in (
        ("peft", ["--peft", str(root / "peft")]),
        ("hf", ["--hf", str(root / "hf")]),
        ("pt", [str(root / "merged.pt")]),
    ):
        assert export_command(["export", paths["step"], *argv]) == 0, kind
        paths[kind] = argv[-1]
    return paths


@pytest.mark.slow
def test_peft_loads_the_adapters_and_computes_the_merged_model(exported):
    from peft import PeftModel

    config = json.loads((Path(exported["peft"]) / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["task_type"] == "CAUSAL_LM"
    assert config["modules_to_save"] == ["transformer.ln_f"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    model = PeftModel.from_pretrained(_base(), exported["peft"]).eval()
    loaded = model.load_adapter(exported["peft"], adapter_name="again")
    assert [k for k in loaded.missing_keys if "again" in k] == [], loaded.missing_keys
    assert loaded.unexpected_keys == [], loaded.unexpected_keys

    merged = _base()
    merged.load_state_dict(torch.load(exported["pt"], weights_only=True))
    got, want = _logits(model), _logits(merged.eval())
    err = (got - want).abs().max().item()
    assert err <= TOL, f"PEFT's logits differ from Bundle's merged model's by {err:.2e}"
    moved = (got - _logits(_base())).abs().max().item()
    assert moved > 1e3 * TOL, f"the adapters hardly moved the logits ({moved:.1e})"


@pytest.mark.slow
def test_the_hf_export_is_peft_merged(exported):
    import transformers
    from peft import PeftModel

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        exported["hf"], output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    plain = PeftModel.from_pretrained(_base(), exported["peft"]).merge_and_unload().eval()
    err = (_logits(hf.eval()) - _logits(plain)).abs().max().item()
    assert err <= TOL, f"the --hf export's logits differ from PEFT's merged model's by {err:.2e}"


@pytest.mark.slow
def test_the_weights_file_is_the_plain_model(exported):
    state = torch.load(exported["pt"], weights_only=True)
    assert set(state) == set(_base().state_dict())
    assert not [k for k in state if "lora_" in k]


@pytest.mark.slow
def test_generate_samples_the_merged_model(exported, capsys):
    argv = ["--prompt", "The ", "--max-new-tokens", "8", "--temperature", "0"]
    assert generate.main([exported["save_dir"], *argv]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ")
    assert generate.main([exported["hf"], *argv, "--seq-len", str(SEQ)]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.slow
def test_a_base_other_than_the_one_trained_on_is_refused(exported, tmp_path, capsys):
    other = _base().state_dict()
    other["transformer.h.0.ln_1.weight"] = other["transformer.h.0.ln_1.weight"] + 1
    torch.save(other, tmp_path / "other.pt")
    out = tmp_path / "out.pt"
    argv = ["export", exported["step"], str(out), "--base", str(tmp_path / "other.pt")]
    assert export_command(argv) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "transformer.h.0.ln_1.weight" in lines[0], lines
    assert "not the one its adapters were trained on" in lines[0] and not out.exists()


def test_peft_of_a_run_without_lora_is_refused(tmp_path, capsys):
    step = tmp_path / "step-1"
    step.mkdir()
    (step / ckpt.INFO).write_text(json.dumps({"step": 1, "model": "mlp", "format": 2}))
    out = tmp_path / "adapter"
    assert export_command(["export", str(step), "--peft", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m bundle.checkpoint: error: --peft"), err
    assert "no LoRA adapters" in err[0] and not out.exists()


LLAMA = (
    "num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2,"
    "num_key_value_heads=1"
)


@pytest.mark.slow
def test_a_llama_step_exports_merged_as_peft_merges_it(tmp_path):
    """A model with a buffer it does not save (Llama's rotary table) exports with --hf."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    save_dir, name = str(tmp_path / "ckpt"), "transformers:LlamaForCausalLM"
    p = start(
        "main.py",
        *("--bundle-shape", "1", "--model", name, "--model-args", LLAMA),
        *("--dataset", "text", "--data-file", "docs/checkpoints.md", "--seq-len", str(SEQ)),
        *("--batch-size", "8", "--itr", "2", "--no-eval", "--lr", "0.05", "--seed", str(SEED)),
        *("--lora", "r=4,alpha=8", "--save-dir", save_dir),
    )
    rc, _, err = finish(p, timeout=300)
    assert rc == 0, err[-3000:]
    step = ckpt.step_dir(save_dir, 2)
    for argv in (["--hf", str(tmp_path / "hf")], ["--peft", str(tmp_path / "peft")]):
        assert export_command(["export", step, *argv]) == 0, argv
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set()), info
    torch.manual_seed(SEED)
    base = models.build(name, num_classes=256, input_shape=(SEQ,), args=parse_model_args(LLAMA))
    plain = PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload().eval()
    err = (_logits(hf.eval()) - _logits(plain)).abs().max().item()
    assert err <= TOL, f"the --hf export's logits differ from PEFT's merged model's by {err:.2e}"
