"""A transformers model's step out to the Hub's format and back (``export --hf``): the step
records the built config, the export loads in ``from_pretrained`` with no missing or unexpected
key and the same logits, tied weights written once as ``save_pretrained`` writes them, shards
with an index, the run's tokenizer copied by an exact list, a --pretrained directory's own
generation config carried over; written whole or not at all; and ``bundle.generate`` reads a
save directory and an export (safetensors only)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from bundle import api, generate, models
from bundle.checkpoint import format as ckpt
from bundle.checkpoint import hf_export
from bundle.checkpoint.__main__ import main as export_command
from bundle.config import parse_model_args
from bundle.session import checkpoint_settings
from tests.support.config import make_config
from tests.support.tokenizers import byte_level_bpe

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
# The step directory is written and read in this one process on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

VOCAB, SEQ = 300, 16
GPT2 = ("transformers:GPT2LMHeadModel", "n_layer=2,n_embd=32,n_head=2")
LLAMA = (
    "transformers:LlamaForCausalLM",
    "num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=2,"
    "num_key_value_heads=1",
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    texts = ["the quick brown fox jumps over the lazy dog " * 4] * 40
    return byte_level_bpe(tmp_path_factory.mktemp("tok"), texts, vocab=VOCAB)


def build(name: str, args: str, config_file: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build(
        name,
        num_classes=VOCAB,
        input_shape=(SEQ,),
        args=parse_model_args(args),
        config_file=config_file,
    ).eval()


def write_step(save_dir: Path, step: int, model, name: str, args: str, changed=(), **record) -> str:
    """A step-N directory as the engine writes it (one process, no process group), recording what
    a run of ``name`` records (bundle.session.checkpoint_settings) unless ``record`` says else;
    ``changed``: entries that differ from the model's."""
    changed = dict(changed)
    tmp = ckpt.step_dir(str(save_dir), step) + ".tmp"
    os.makedirs(tmp)
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"model.{k}": v for k, v in changed.items()})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    info = {
        "step": step,
        "format": ckpt.FORMAT,
        "model": name,
        "model_args": args,
        "model_output": None,
        "num_classes": VOCAB,
        "input_shape": [SEQ],
        "tokenizer": None,
        "hf_config": hf_export.record(model),
        **record,
    }
    final = ckpt.step_dir(str(save_dir), step)
    ckpt.publish(tmp, final, {k: v for k, v in info.items() if v is not ...})
    return final


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return models.forward(model.eval(), ids)


def safetensors_keys(directory: str) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys |= set(f.keys())
    return keys


def test_a_step_of_a_transformers_run_records_the_config_it_was_built_with(tmp_path):
    cfg = make_config(
        model={"name": GPT2[0], "args": GPT2[1]},
        checkpoint={"save_dir": str(tmp_path / "ckpt")},
    )
    session = SimpleNamespace(
        splits=SimpleNamespace(num_classes=VOCAB, input_shape=(SEQ,)),
        layout=SimpleNamespace(as_dict=lambda: {}),
    )
    got = json.loads(json.dumps(checkpoint_settings(cfg, session)))["hf_config"]
    assert got["class"] == "GPT2LMHeadModel"
    want = build(*GPT2).config
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "tie_word_embeddings"):
        assert got["config"][key] == getattr(want, key), key
    other = make_config(checkpoint={"save_dir": str(tmp_path / "ckpt")})  # digits_cnn
    assert "hf_config" not in checkpoint_settings(other, session)
    # --pretrained DIR: the config is the directory's (its own layers), not the class default.
    build(GPT2[0], "n_layer=1,n_embd=32,n_head=2").save_pretrained(str(tmp_path / "hub"))
    hub = make_config(
        model={"pretrained": str(tmp_path / "hub")},
        checkpoint={"save_dir": str(tmp_path / "ckpt")},
    )
    got = checkpoint_settings(hub, session)["hf_config"]
    assert (got["class"], got["config"]["n_layer"], got["config"]["n_embd"]) == (
        "GPT2LMHeadModel",
        1,
        32,
    )


@pytest.mark.parametrize("name,args", [GPT2, LLAMA], ids=["gpt2-tied", "llama"])
def test_the_export_loads_in_transformers_with_every_key_and_the_same_logits(
    name, args, tokenizer, tmp_path, capsys
):
    model = build(name, args)
    step = write_step(tmp_path / "ckpt", 3, model, name, args, tokenizer=tokenizer)
    out = str(tmp_path / "hf")
    assert export_command(["export", step, "--hf", out]) == 0
    line = capsys.readouterr()
    assert line.err == "" and line.out.startswith(f"wrote {out}: {name.partition(':')[2]}, ")
    assert "1 safetensors file(s)" in line.out and "tokenizer (tokenizer.json)" in line.out
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    assert info["mismatched_keys"] == set()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(logits(loaded, ids), logits(model, ids), atol=1e-5, rtol=0)
    # Tied weights once, as transformers' own save_pretrained writes the same model.
    model.save_pretrained(str(tmp_path / "reference"))
    assert safetensors_keys(out) == safetensors_keys(str(tmp_path / "reference"))
    text = "the lazy dog"
    ours = transformers.AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False)
    assert ours == generate.tokenizer.load(tokenizer).encode(text)


def test_a_small_max_shard_size_writes_shards_and_an_index_that_load(tmp_path):
    model = build(*GPT2)
    step = write_step(tmp_path / "ckpt", 2, model, *GPT2)
    out = str(tmp_path / "hf")
    done = api.export_hf(step, out, max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert done.shards == len(shards) > 1 and "model.safetensors.index.json" in os.listdir(out)
    assert done.tokenizer == () and "lm_head.weight" not in safetensors_keys(out)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    ids = torch.arange(SEQ).unsqueeze(0)
    assert torch.allclose(logits(loaded, ids), logits(model, ids), atol=1e-5, rtol=0)
    with pytest.raises(hf_export.ConfigError, match="--max-shard-size"):
        api.export_hf(step, str(tmp_path / "x"), max_shard_size="lots")


def refused(capsys, *argv: str) -> str:
    assert export_command(["export", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    assert lines[0].startswith("python -m bundle.checkpoint: error: ")
    return lines[0]


def test_an_export_is_written_whole_or_not_at_all_and_replaces_only_with_force(
    tmp_path, capsys, monkeypatch
):
    step = write_step(tmp_path / "ckpt", 1, build(*GPT2), *GPT2)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert "give --force to replace it" in refused(capsys, step, "--hf", str(out))
    for holder in (step, str(tmp_path / "ckpt"), str(tmp_path)):  # --force never deletes it
        assert "holds the checkpoint" in refused(capsys, step, "--hf", holder, "--force")
    assert os.listdir(out) == ["mine.txt"]

    def broken(source, where):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "copy_tokenizer", broken)
    with pytest.raises(OSError):
        hf_export.export_hf(step, str(out), force=True, tokenizer=str(tmp_path))
    assert os.listdir(out) == ["mine.txt"] and not os.path.exists(f"{out}.partial")
    monkeypatch.undo()
    os.makedirs(f"{out}.partial")  # what a killed export leaves
    assert export_command(["export", step, "--hf", str(out), "--force"]) == 0
    assert "config.json" in os.listdir(out) and "mine.txt" not in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]


def test_a_model_of_another_kind_or_a_damaged_step_is_one_line(tmp_path, capsys):
    gpt = models.build("gpt", num_classes=256, input_shape=(SEQ,), args={"layers": 1})
    step = write_step(tmp_path / "a", 1, gpt, "gpt", "layers=1", hf_config=...)
    line = refused(capsys, step, "--hf", str(tmp_path / "hf"))
    assert "--hf is for transformers models" in line and "OUT.pt" in line
    assert export_command(["export", step, str(tmp_path / "gpt.pt")]) == 0  # as before
    capsys.readouterr()
    damaged = write_step(tmp_path / "b", 1, build(*GPT2), *GPT2)
    os.unlink(os.path.join(damaged, ".metadata"))
    assert refused(capsys, damaged, "--hf", str(tmp_path / "hf")).endswith(
        f"{damaged}: no .metadata; nothing exported"
    )
    for argv in ([step], [step, "x.pt", "--hf", "y"]):  # usage, as argparse says it
        assert export_command(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: python -m bundle.checkpoint export") and "one of them" in err
    assert not os.path.exists(tmp_path / "hf")


def test_tied_copies_that_differ_are_refused_rather_than_one_dropped(tmp_path, capsys):
    model = build(*GPT2)
    head = {"lm_head.weight": model.lm_head.weight.detach() + 1}
    step = write_step(tmp_path / "ckpt", 1, model, *GPT2, changed=head)
    line = refused(capsys, step, "--hf", str(tmp_path / "hf"))
    assert "lm_head.weight differs from the weight it is tied to" in line
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "hf.partial")


def test_a_step_without_the_record_is_rebuilt_from_its_arguments_and_model_config(tmp_path, capsys):
    plain = build(*GPT2)
    step = write_step(tmp_path / "a", 1, plain, *GPT2, hf_config=...)
    assert "hf_config" not in ckpt.read_info(step)
    assert export_command(["export", step, "--hf", str(tmp_path / "a-hf")]) == 0
    capsys.readouterr()
    # A run given --model-config (not recorded before hf_config was): export needs it too.
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"n_inner": 48, "n_layer": 1}))
    sized = build(GPT2[0], "n_embd=32,n_head=2", str(config))
    step = write_step(tmp_path / "b", 1, sized, GPT2[0], "n_embd=32,n_head=2", hf_config=...)
    assert "another --model-config" in refused(capsys, step, "--hf", str(tmp_path / "b-hf"))
    argv = [step, "--hf", str(tmp_path / "b-hf"), "--model-config", str(config)]
    assert export_command(["export", *argv]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b-hf"))
    ids = torch.arange(SEQ).unsqueeze(0)
    assert torch.allclose(logits(loaded, ids), logits(sized, ids), atol=1e-5, rtol=0)


def pretrained_step(tmp_path: Path, keep_hub: bool = False, **generation) -> tuple[str, Path]:
    """A step of a run from --pretrained HUB, recorded as checkpoint_settings records it; HUB a
    GPT-2's save_pretrained directory with a generation_config.json of its own (``generation``);
    ``keep_hub``: HUB's config and weights as the caller saved them."""
    hub = tmp_path / "hub"
    model = build(*GPT2)
    if not keep_hub:
        model.save_pretrained(str(hub))
    transformers.GenerationConfig(**generation).save_pretrained(str(hub))
    cfg = make_config(
        model={"pretrained": str(hub)}, checkpoint={"save_dir": str(tmp_path / "ckpt")}
    )
    session = SimpleNamespace(
        splits=SimpleNamespace(num_classes=VOCAB, input_shape=(SEQ,)),
        layout=SimpleNamespace(as_dict=lambda: {}),
    )
    settings = json.loads(json.dumps(checkpoint_settings(cfg, session)))
    assert settings["pretrained"] == str(hub)
    step = write_step(
        tmp_path / "ckpt", 1, model, *GPT2, pretrained=str(hub), hf_config=settings["hf_config"]
    )
    return step, hub


def test_a_pretrained_run_exports_its_directory_s_own_generation_config(tmp_path, capsys):
    step, hub = pretrained_step(tmp_path, do_sample=True, top_k=7, max_length=33, eos_token_id=5)
    capsys.readouterr()
    out = str(tmp_path / "hf")
    assert export_command(["export", step, "--hf", out]) == 0
    assert capsys.readouterr().err == ""
    got = transformers.GenerationConfig.from_pretrained(out)
    assert (got.do_sample, got.top_k, got.max_length, got.eos_token_id) == (True, 7, 33, 5)
    written = Path(out, "generation_config.json").read_text()
    assert written == (hub / "generation_config.json").read_text()  # as transformers writes it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (loaded.generation_config.top_k, loaded.generation_config.max_length) == (7, 33)
    capsys.readouterr()
    # The directory gone since: the model config's, as before, and one line says so.
    shutil.rmtree(hub)
    assert export_command(["export", step, "--hf", out, "--force"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{hub} (the run's --pretrained) is gone" in err[0], err
    got = transformers.GenerationConfig.from_pretrained(out)
    assert (got.top_k, got.max_length) != (7, 33)


def test_an_auto_map_of_the_pretrained_directory_is_left_out_of_the_export(tmp_path, capsys):
    """Custom code a --pretrained config.json names never ran: the export is the class trained."""
    hub = tmp_path / "hub"
    build(*GPT2).save_pretrained(str(hub))
    data = json.loads((hub / "config.json").read_text())
    data["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyGPT2"}
    (hub / "config.json").write_text(json.dumps(data))
    step, _ = pretrained_step(tmp_path, keep_hub=True)
    assert "auto_map" in json.loads(Path(step, "bundle.json").read_text())["hf_config"]["config"]
    capsys.readouterr()
    out = str(tmp_path / "hf")
    assert export_command(["export", step, "--hf", out]) == 0
    said = capsys.readouterr().out
    assert "leaves out the source's auto_map" in said and "GPT2LMHeadModel" in said, said
    assert "auto_map" not in json.loads(Path(out, "config.json").read_text())
    transformers.AutoModelForCausalLM.from_pretrained(out)  # no code asked for


def test_a_pretrained_generation_config_is_read_as_json_data_only(tmp_path, capsys):
    step, hub = pretrained_step(tmp_path, do_sample=True, top_k=7)
    capsys.readouterr()
    mine = hub / "generation_config.json"
    mine.unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"do_sample": True, "top_k": 3}))
    mine.symlink_to(tmp_path / "elsewhere.json")
    out = str(tmp_path / "hf")
    assert "is no regular file" in refused(capsys, step, "--hf", out)
    mine.unlink()
    for text, why in [
        ("[1, 2]", "not a JSON object"),
        ("{not json", "cannot read it"),
        (" " * (1 << 20) + "{}", "larger than"),
        (json.dumps({"max_new_tokens": 0}), "GenerationConfig refuses it"),
    ]:
        mine.write_text(text)
        line = refused(capsys, step, "--hf", out)
        assert str(mine) in line and why in line, line
    assert not os.path.exists(out) and not os.path.exists(f"{out}.partial")
    mine.unlink()  # none: the model config's, as a run not from --pretrained
    assert export_command(["export", step, "--hf", out]) == 0
    assert capsys.readouterr().err == ""


def test_only_regular_tokenizer_files_of_known_names_are_copied(tokenizer, tmp_path):
    source = tmp_path / "tok"
    source.mkdir()
    (source / "tokenizer.json").write_bytes(Path(tokenizer, "tokenizer.json").read_bytes())
    (source / "vocab.json").symlink_to("/etc/passwd")
    (source / "merges.txt").mkdir()
    (source / "setup.py").write_text("import os")
    out = tmp_path / "out"
    out.mkdir()
    assert hf_export.copy_tokenizer(str(source), str(out)) == ("tokenizer.json",)
    assert os.listdir(out) == ["tokenizer.json"]
    with pytest.raises(hf_export.ConfigError, match="give --tokenizer DIR"):
        hf_export.copy_tokenizer(str(tmp_path / "gone"), str(out))


def _text(capsys, *argv: str) -> str:
    assert generate.main([*argv, "--prompt", "the ", "--max-new-tokens", "8"]) == 0, capsys
    return capsys.readouterr().out


def test_generate_reads_a_save_dir_and_an_export_alike(tokenizer, tmp_path, capsys):
    model = build(*GPT2)
    save_dir = tmp_path / "ckpt"
    step = write_step(save_dir, 4, model, *GPT2, tokenizer=tokenizer)
    os.makedirs(save_dir / "step-9")  # a newer one, not whole: passed over
    out = str(tmp_path / "hf")
    hf_export.export_hf(step, out, max_shard_size="20KB")
    from_step = _text(capsys, step, "--temperature", "0")
    assert _text(capsys, str(save_dir), "--temperature", "0") == from_step
    assert _text(capsys, out, "--temperature", "0", "--seq-len", str(SEQ)) == from_step
    assert _text(capsys, out, "--seed", "3") == _text(capsys, step, "--seed", "3")


def test_generate_reads_weights_of_an_export_from_safetensors_only(tmp_path, capsys):
    out = tmp_path / "hf"
    build(*GPT2).save_pretrained(str(out))
    os.replace(out / "model.safetensors", out / "pytorch_model.bin")
    assert generate.main([str(out), "--prompt", "x"]) == 2
    assert "holds pytorch_model.bin, not safetensors" in capsys.readouterr().err
    index = out / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    assert generate.main([str(out), "--prompt", "x"]) == 2
    assert "weight_map is no mapping of tensor names to file names" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["os.system"]}))
    assert generate.main([str(out), "--prompt", "x"]) == 2
    assert "must name a transformers model class" in capsys.readouterr().err


def test_export_of_a_save_dir_takes_its_newest_whole_step_and_says_so(tmp_path, capsys):
    model = build(*GPT2)
    save_dir = tmp_path / "ckpt"
    step = write_step(save_dir, 4, model, *GPT2)
    os.makedirs(save_dir / "step-9")  # a newer one, not whole: passed over
    assert export_command(["export", str(save_dir), "--hf", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint" in err and f"{step} (the newest whole checkpoint)" in err
    assert export_command(["export", str(tmp_path / "empty"), "--hf", str(tmp_path / "x")]) == 2
