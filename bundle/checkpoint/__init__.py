"""Checkpoints: what is on disk, and when the training loop writes and reads it.

Modules, from the data up:

- ``format``: the final weights file, resumable ``step-N`` directories (DCP), their settings,
  resolving ``--resume``, export (``python -m bundle.checkpoint export``);
- ``manager``: ``Checkpointer``, the loop's component: when a save is due, what one rank saves,
  asynchronous writes, pruning, and restoring under any shape.
"""
