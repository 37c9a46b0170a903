"""Checkpoints: what is on disk, and when the training loop writes and reads it.

Modules, from the data up:

- ``index``: a checkpoint's DCP index read as data (an exact allow-list), never as code;
- ``format``: the final weights file, resumable ``step-N`` directories (DCP), their settings and
  checksums, re-saves that keep a whole copy and what a kill left put right, resolving
  ``--resume`` past damaged ones, export (``python -m bundle.checkpoint export``);
- ``final``: ``--checkpoint FILE``, the weights at the end of a run gathered from the stages
  into one file (a ``--lora`` run's: what trains);
- ``hf_record``: a ``transformers`` model's class and config as a step records them
  (``hf_config``), and the model built again from that record, checked first;
- ``merged``: a ``--lora`` run's step as the plain model: its frozen base built again as the run
  built it, checked against the step's digests, the adapters folded in;
- ``hf_export``: a ``transformers`` model's step as a ``from_pretrained`` directory (``export
  --hf``; a ``--lora`` run's merged), and such a directory read back as data (``bundle.generate``);
- ``peft_export``: a ``--lora`` run's adapters as the directory PEFT reads (``export --peft``);
- ``hf_files``: what goes into an export beside the weights, read as data: the run's tokenizer
  files (an exact list of names) and a ``--pretrained`` directory's generation config;
- ``lock``: ``DirLock``, one job per save directory;
- ``parts``: the typed values a ``Checkpointer`` is built from: what one rank's checkpoint holds
  (``RankParts``: stage, optimizer, outer sync, gradient-compression hop, extras) and where and
  when it saves (``SaveSettings``);
- ``state``: ``RankState``, one rank's training state by named parts, defined once: what a
  checkpoint saves, and what fault tolerance carries, hands over and sends to a healed bundle;
- ``split_state``: a tensor-parallel rank's entries: its split layers gathered whole for a save,
  its shards taken from the whole tensors on restore;
- ``manager``: ``Checkpointer``, the loop's component: when a save is due, what one rank saves,
  asynchronous writes, saves that cannot complete, pruning, and restoring under any shape.
"""
