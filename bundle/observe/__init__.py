"""Observing a run: where each step's time goes and what a run reports of itself.

Modules, from the data up:

- ``timing``: the step timer's laps around the engine's actions, the per-stage breakdown;
- ``trace``: traced steps merged into one Chrome/Perfetto trace, the kernel profiler;
- ``console``: the progress bar or plain lines on the reporting rank;
- ``board``: TensorBoard scalars;
- ``metrics``: the throughput meter, the JSON-lines metrics file, and the ``Reporter``;
- ``build``: a process's reporter, profiler and trace, built from the config.
"""
