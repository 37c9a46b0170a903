"""The runtime: the processes of a job, how they find each other, fail, stop and restart.

Modules, from the data up:

- ``devices``: the backend a run uses, this node's devices, per-process settings;
- ``store``: the job's TCPStore: rendezvous, the nodes' settings compared, barriers, abort;
- ``groups``: ``ProcessGroups``, every process group of a rank, built once, collectively;
- ``phase``: what a process is doing now, for its watchdog and its error reports;
- ``preemption``: stop signals (SIGTERM/SIGINT), the stop vote and the ``BUNDLE_FAULT`` hook;
- ``watchdog``: the step watchdog and the groups' timeouts;
- ``process``: one training process around its session and trainer (self-spawned or torchrun);
- ``supervisor``: a node's workers started, watched, restarted and stopped;
- ``throttle``: CPU quotas (cgroups) that emulate slower devices for a plan's ``cpu`` shares;
- ``slurm``: a Slurm job step as the node layout;
- ``localworld``: N loopback processes for tests and benchmarks.
"""
