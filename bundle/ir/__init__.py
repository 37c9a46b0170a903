"""The schedule IR: what a stage does in a step and the calls it posts, as pure data (no torch).

Modules, from the data up:

- ``schedule``: the schedules' registry (GPipe, 1F1B, ZB-H1, interleaved 1F1B, ZBV): pure lists of
  actions per stage, each naming its micro-batch and model chunk;
- ``rounds``: the calls of stages with several model chunks, posted in lockstep rounds;
- ``p2p``: the point-to-point calls those actions make in a step, and a model of NCCL's streams.

The engine runs these lists (``bundle.engine``); the planner simulates them (``bundle.plan``).
"""
