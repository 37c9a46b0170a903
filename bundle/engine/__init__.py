"""The engine: one replica of one stage running a training step through the pipeline schedule.

It runs the schedule IR (``bundle.ir``: actions and calls, pure) over the collectives
(``bundle.collectives``: the ``Comm`` interface and the NCCL emulation).

Modules, from the data up:

- ``transport``: activations forward and gradients back between stages of any widths, posting
  the calls ``bundle.ir.p2p`` derives from the schedule;
- ``aggregate``: how bundles' contributions combine (mean, median, trimmed), and a faulty bundle;
- ``hops``: the hop between bundles of a sync: exact, compressed (bf16, fp16, PowerSGD), robust,
  and the groups of a sync in two hops;
- ``grad_sync``: a stage's gradients summed over its replicas (flat or hierarchical);
- ``ties``: weights tied across stages, their gradients summed among the stages holding them;
- ``outer``: bundles that meet every H steps (local SGD, DiLoCo) and their outer optimizer;
- ``precision``: the compute policy: dtypes, the boundary's wire form, loss scaling;
- ``optim``: a stage's optimizer (SGD, AdamW, Adam), its parameter groups, ZeRO-1 sharding;
- ``sharded``: ``--zero 3``: a stage's parameters, gradients and optimizer state sharded over
  its replicas by FSDP2, one unit per block, and the sync that leaves the sums to FSDP;
- ``data_parallel``: a rank's data-parallel side built from the run's config: its gradient
  sync, the group ZeRO-1 shards over, the meetings between bundles, the tied weights' sum;
- ``split_backward``: a backward in two halves, input and weight (zero-bubble schedules);
- ``memory``: recompute of a stage's blocks, and a count of what backward keeps;
- ``loss``: the loss a stage computes and what evaluation counts (top-k hits, rows);
- ``stage``: ``Stage``, one piece of the model as a module, named as in the full model;
- ``compiled``: ``--compile``: each block of a stage compiled in place, and the time it took;
- ``tensor_parallel``: a stage's layers split over its replica's TP group (``--tensor-parallel``)
  and the boundary's messages between TP groups of any degrees;
- ``stages``: the stages cut from the model, and what crosses each boundary between them;
- ``parts``: what a ``StageEngine`` is built from (its chunks, optimizer, syncs, step options);
- ``stage_engine``: ``StageEngine``, which runs a step's actions (over its model chunks), calls
  and optimizer step.
"""
