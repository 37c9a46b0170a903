"""The planner: which bundle shape, split, micro-batch count, schedule and sync strategy to run.

Modules, from the data up:

- ``anatomy``: per-block parameters, boundary and saved bytes and FLOPs, counted on the meta device;
- ``cache``: the cache of profiles, JSON files named by what they depend on;
- ``profile``: per-block timings measured on the local device, read and kept through the cache;
- ``conditions``: what a profile was measured under (load, CPU share, spread) and whether to trust it;
- ``cluster``: the devices and links a plan runs on (YAML cluster files, or this machine);
- ``isolate``: a measurement run in a spawned child process (no CUDA left in the caller);
- ``messages``: what one point-to-point message costs here: a ping-pong over the boundary's sizes;
- ``calibrate``: the engine's own overheads and this machine's loopback links, measured once;
- ``calibrate_tp``: what a tensor-parallel sum costs inside a step on this machine, fitted;
- ``shares``: how much slower than its CPU share an emulated device computes, measured once;
- ``cost``: seconds and bytes of a plan's pieces: stage compute, transfers, gradient sync, memory;
- ``dataparallel``: the user's data-parallel options (compression, bundle sync, aggregation) costed;
- ``zero``: ``--zero 3`` costed: sharded memory, each block gathered and reduced per micro-batch;
- ``tensor``: tensor parallelism per stage costed: what a model splits, a stage at degree t;
- ``layout``: what a simulation takes (a plan's layout) and gives (the step, its timeline);
- ``simulate``: an event simulation of the engine's own schedule action lists;
- ``split``: stage widths and split points: the dynamic program, widths coarse to fine;
- ``plans``: one plan as a value, simulated with its memory counted, and plans ranked;
- ``estimate``: the closed-form step time that ranks a search's candidates before simulation;
- ``search``: enumerate plans, split by a dynamic program, rank by simulated throughput;
- ``mixed``: the search on several device types: placement, widths, split and row weights;
- ``planner``: one request's checks, cost model and search;
- ``report``: the ranked table, the JSON, the main.py command and the picture of a plan;
- ``auto``: ``--bundle-shape auto`` / ``--partition auto`` for main.py.
"""
