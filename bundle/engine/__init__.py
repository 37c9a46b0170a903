"""The engine: one replica of one stage running a training step through the pipeline schedule.

Modules, from the data up:

- ``schedule``: the schedules' registry (GPipe, 1F1B, ZB-H1, interleaved 1F1B, ZBV): pure lists of
  actions per stage, each naming its micro-batch and model chunk;
- ``rounds``: the calls of stages with several model chunks, posted in lockstep rounds;
- ``p2p``: the point-to-point calls those actions make in a step, and a model of NCCL's streams;
- ``transport``: activations forward and gradients back between stages of any widths;
- ``comm``: the collectives of training's NCCL groups behind one interface (torch's, emulated);
- ``device_audit``: under nccl-emu, device tensors told from host ones, and CUDA's mixing refused;
- ``emu_stream``: the emulation's in-order streams, one per communicator, and their calls;
- ``nccl_emu``: ``--backend nccl-emu``, gloo with NCCL's in-order streams on top;
- ``aggregate``: how bundles' contributions combine (mean, median, trimmed), and a faulty bundle;
- ``hops``: the hop between bundles of a sync: exact, compressed (bf16, fp16, PowerSGD), robust,
  and the groups of a sync in two hops;
- ``grad_sync``: a stage's gradients summed over its replicas (flat or hierarchical);
- ``ties``: weights tied across stages, their gradients summed among the stages holding them;
- ``outer``: bundles that meet every H steps (local SGD, DiLoCo) and their outer optimizer;
- ``precision``: the compute policy: dtypes, the boundary's wire form, loss scaling;
- ``optim``: a stage's optimizer (SGD, AdamW, Adam), its parameter groups, ZeRO-1 sharding;
- ``split_backward``: a backward in two halves, input and weight (zero-bubble schedules);
- ``memory``: recompute of a stage's blocks, and a count of what backward keeps;
- ``loss``: the loss a stage computes and what evaluation counts (top-k hits, rows);
- ``stages``: the stages cut from the model, and what crosses each boundary between them;
- ``parts``: what a ``StageEngine`` is built from (its chunks, optimizer, syncs, step options);
- ``stage_engine``: ``StageEngine``, which runs a step's actions (over its model chunks), calls
  and optimizer step.
"""
