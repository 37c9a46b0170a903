"""The runtime below the trainer: what a training process stands on to find its peers, fail,
stop and restart. The launching side (processes started, supervised, restarted) is
``bundle.launch``, a floor above the trainer; nothing here imports it.

Modules, from the data up:

- ``keys``: every key of the job's store, spelled once, and the map of its key space;
- ``devices``: the backend a run uses, this node's devices, per-process settings;
- ``control``: the store's control keys (abort, dead marks): checked before they act, sealed with
  a job secret;
- ``store``: the job's TCPStore, listening where asked: rendezvous, the nodes' settings compared,
  barriers, abort;
- ``groups``: ``ProcessGroups``, every process group of a rank, built once, collectively;
- ``phase``: what a process is doing now, for its watchdog and its error reports;
- ``preemption``: stop signals (SIGTERM/SIGINT), the stop vote and the ``BUNDLE_FAULT`` hook;
- ``watchdog``: the step watchdog and the groups' timeouts.
"""
