"""LoRA's yardstick: PEFT itself. An adapter PEFT saved (A and B both random, so the first step
already moves both), and one process training ``peft.PeftModel`` over the same base on the same
global batches, as ``tests.support.reference`` does for full training."""

from __future__ import annotations

import torch

from bundle import data, models
from bundle.config import RunConfig
from bundle.data import loader
from bundle.engine.optim import make_optimizer
from bundle.lr_schedule import LRSchedule
from bundle.session import make_loss


def base_model(cfg: RunConfig) -> torch.nn.Module:
    """The base the run builds (same seed, same data shape), before any adapter."""
    splits = data.load(cfg.data, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    return models.build_model(cfg.model, splits.num_classes, splits.input_shape)


def save_adapter(cfg: RunConfig, out: str, *, r: int, alpha: float, targets, seed: int = 11):
    """A PEFT adapter for ``cfg``'s base, with random A and B, saved to ``out``."""
    from peft import LoraConfig, get_peft_model

    base = base_model(cfg)
    torch.manual_seed(seed)
    model = get_peft_model(
        base,
        LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False),
    )
    model.save_pretrained(out)
    return out


def ours(name: str) -> str:
    """A PEFT model's parameter name as Bundle's model names it."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".default.", ".").replace(".base_layer.", ".")


def peft_reference(
    cfg: RunConfig, adapter: str, *, grads: dict | None = None, steps: int | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter, by Bundle's names, after ``cfg.train.steps`` steps of one process
    training PEFT's model of ``adapter`` (``steps`` of them where given; ``grads``: filled with the
    first step's gradients)."""
    from peft import PeftModel

    splits = data.load(cfg.data, cfg.train.seed)
    model = PeftModel.from_pretrained(base_model(cfg), adapter, is_trainable=True)
    opt = make_optimizer(cfg.train, model)
    schedule = LRSchedule.of(
        cfg.train,
        steps_per_epoch=data.steps_per_epoch(len(splits.train), cfg.train.batch_size),
        total=cfg.train.steps,
    )
    loss_fn = make_loss(cfg)
    n = data.size(splits.train)
    for step in range(cfg.train.steps if steps is None else steps):
        idx = data.global_batch(n, cfg.train.batch_size, cfg.train.seed, step)
        x, y = next(loader.micro_batches(splits.train, [idx], workers=0))
        schedule.apply(opt, step)
        opt.zero_grad()
        out = model(input_ids=x, use_cache=False).logits
        loss_fn(out.float(), y).backward()
        if grads is not None and step == 0:
            grads.update(
                {ours(k): p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
            )
        opt.step()
    return {ours(k): v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
