"""Launching: the floor above the trainer that starts, watches and restarts a job's processes.

It builds on ``bundle.runtime`` (devices, the job store, groups, stop signals, watchdogs) and on
the session and trainer; nothing below it (runtime, engine, session, trainer) imports it.

- ``context``: what a training process is started with, passed whole (``WorkerStart``), and
  in the process, with its store, phase and stop request (``ProcessContext``);
- ``process``: one training process around its session and trainer (self-spawned or torchrun);
- ``supervisor``: a node's workers started, watched, restarted and stopped;
- ``liveness``: the workers' signs of life, and a stopped or frozen one named;
- ``nodes``: the nodes' heartbeats (a silent node found) and node 0's wait for the others;
- ``ft/``: ``--fault-tolerance bundle``: membership, a world per epoch, the heal and the handoff;
  its map is the failure map (what fails, who sees it, who handles it, the exit code);
- ``throttle``: CPU quotas (cgroups) that emulate slower devices for a plan's ``cpu`` shares;
- ``slurm``: a Slurm job step as the node layout;
- ``localworld``: N loopback processes for tests, benchmarks and the planner's calibration.
"""
