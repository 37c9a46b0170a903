"""Bundle: synchronous hybrid (pipeline x data) parallel training with per-stage widths.

From the data up:

- ``errors``, ``log``: typed errors carrying the offending value; one rank-prefixed logger;
- ``config/``: the frozen ``RunConfig`` and its sections (every name importable from
  ``bundle.config``), how far each setting reaches, the data-parallel options' spellings, the
  options table it is declared in, and YAML read as data (no alias that expands);
- ``cli``: the command line and YAML that build the config;
- ``row_weights``, ``rows``, ``topology``: the ``--row-weights`` spelling of each replica's share
  of a micro-batch; a micro-batch's rows cut among a stage's replicas and the rows that cross
  between stages (pure arithmetic); the job's ranks, groups and row plans as one pure value;
- ``lr_schedule``: the learning rate of every step;
- ``data/``: the datasets, text to tokens, how one sample is read, the order samples are trained
  in (the same under any shape), a stage's micro-batches read in order (loader workers);
- ``models/``: models by name, a user's factory, ``transformers`` classes, their cut into
  blocks, ``--partition`` specs (where each piece begins) and the cut into pieces there (the
  layout's top-level ``models/`` folder, imported as ``bundle.models`` only, so a user's own
  ``models`` package never meets it);
- ``plan_file``: ``--plan FILE``: a planner's saved plan (options, placement, data) to run as is;
- ``preflight``: every check made before a process starts;
- ``ir/``: the schedule IR, pure: each stage's actions (the schedules' registry), lockstep
  rounds, a step's point-to-point calls and their replay on NCCL's in-order streams;
- ``collectives/``: the NCCL groups' collectives behind one interface, ``--backend nccl-emu``
  and its device audit;
- ``engine/``: one replica of one stage running a step (transport, sync, precision, optimizer);
- ``session``: one rank's stage, groups, engine and data, built once;
- ``evaluate``, ``trainer``: the validation pass, and the ``Trainer`` whose loop drives it all;
- ``checkpoint/``, ``observe/``: what is saved and resumed; what a run reports of itself;
- ``runtime/``: below the trainer: devices, the job's store, groups, phase, stop signals,
  watchdogs;
- ``launch/``: above the trainer: a job's processes started, supervised and restarted, Slurm,
  CPU quotas for emulated devices;
- ``plan/``: the planner behind ``--bundle-shape auto``;
- ``api``: ``train(model, dataset=, loss=, **options)``: what main.py runs, from Python;
- ``generate``: ``python -m bundle.generate CHECKPOINT --prompt TEXT``: sampling after training.
"""
