"""The planner: which bundle shape, split, micro-batch count, schedule and sync strategy to run.

profile.py    per-block costs of a model: counted (meta device) and measured (local device)
cluster.py    the devices and links a plan runs on (YAML cluster files, or this machine)
calibrate.py  the engine's own overheads and this machine's loopback links, measured once
cost.py       seconds and bytes of one plan's pieces: stage compute, transfers, gradient sync
simulate.py   an event simulation of the engine's own schedule action lists
search.py     enumerate plans, split by a dynamic program, rank by simulated throughput
report.py     the ranked table, the JSON, the main.py command and the picture of a plan
auto.py       --bundle-shape auto / --partition auto for main.py
"""
