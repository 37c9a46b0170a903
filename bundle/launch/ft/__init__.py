"""``--fault-tolerance bundle``: a lost bundle leaves, the others train on, it heals and rejoins.

Modules, from the store up:

- ``membership``: which bundles train, agreed through the job's store after a loss (epochs,
  check-ins, the decision, admissions of a healed bundle), and the dead marks;
- ``handoff``: on NCCL (and nccl-emu) a survivor's state written for a new process of its rank,
  and the step guard that keeps it from being taken halfway through an update;
- ``epochs``: one process's training, a world per membership epoch: the loss watch, the state
  carried across (``bundle.checkpoint.state.RankState``), a heal's state sent from a peer;
- ``heal``: a node supervisor's side: a lost bundle marked, reaped and started again.

The engine takes its part as declared hooks (``bundle.engine.parts.StepHooks``: the commit vote
and the end of the update); the trainer a membership view (``Links.asks``, the bundles ready to
rejoin). What can fail, who sees it, who handles it, and how the process ends
(``bundle.errors.ExitCode``):

| failure | seen by | handled by | exit |
| --- | --- | --- | --- |
| a worker dies (killed, crashed) | its node supervisor (the exit) | ``heal.Healer.lose``: its bundle marked dead, its other workers reaped, started again under ``--max-restarts`` | the dead one's; the bundle's others ``LEFT`` (3) |
| a worker freezes or stalls | its supervisor (no sign of life for half of ``--timeout``) | the same, as a dead one | killed |
| a peer is lost in a step | every survivor (its collective fails; on NCCL the loss watch sees the mark) | ``epochs``: keeps its state, drops the epoch, ``membership.agree``, trains the step again | none: trains on (on NCCL ``HANDOFF`` (4), its rank started again at once) |
| this process's own bundle is out | the process (``Membership.gone``) | leaves (``BundleLeft``) | ``LEFT`` (3) |
| fewer than ``--min-bundles`` remain | the survivors (``membership.agree``) | ``TooFewBundles``: the job fails, said as the job's failure naming the lost bundle and step | ``FAILED`` (1); ``--max-restarts`` restarts the job from its checkpoint |
| members committed different steps | the survivors (``membership.agree``) | ``TooFewBundles``: resume from the newest checkpoint | ``FAILED`` (1) |
| a healed bundle's process fails as it starts | its supervisor | that heal is over (``lose``), the next one tried | ``LEFT`` (3) for the others |
| node 0 (the job's store) is lost | every process (the store is gone) | not here: the job is lost (``--max-restarts`` and the checkpoints, as under ``restart``) | ``FAILED`` (1) |
| a process's own fault (not a lost peer) | the process | the job fails, as without fault tolerance | ``FAILED`` (1) |

A new kind of failure gets a row here and one place in these modules (docs/extending.md).
"""
