"""The planner: which bundle shape, split, micro-batch count, schedule and sync strategy to run.

Modules, from the data up:

- ``anatomy``: per-block parameters, boundary and saved bytes and FLOPs, counted on the meta device;
- ``profile``: per-block timings measured on the local device, and the cache of profiles;
- ``conditions``: what a profile was measured under (load, CPU share, spread) and whether to trust it;
- ``cluster``: the devices and links a plan runs on (YAML cluster files, or this machine);
- ``isolate``: a measurement run in a spawned child process (no CUDA left in the caller);
- ``calibrate``: the engine's own overheads and this machine's loopback links, measured once;
- ``shares``: how much slower than its CPU share an emulated device computes, measured once;
- ``cost``: seconds and bytes of a plan's pieces: stage compute, transfers, gradient sync, memory;
- ``dataparallel``: the user's data-parallel options (compression, bundle sync, aggregation) costed;
- ``simulate``: an event simulation of the engine's own schedule action lists;
- ``search``: enumerate plans, split by a dynamic program, rank by simulated throughput;
- ``mixed``: the search on several device types: placement, widths, split and row weights;
- ``planner``: one request's checks, cost model and search;
- ``report``: the ranked table, the JSON, the main.py command and the picture of a plan;
- ``auto``: ``--bundle-shape auto`` / ``--partition auto`` for main.py.
"""
