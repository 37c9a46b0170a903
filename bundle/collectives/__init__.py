"""The collectives: training's NCCL groups behind one interface, and their emulation on the CPU.

Modules, from the data up:

- ``comm``: the collectives of training's NCCL groups behind one interface (torch's, emulated);
- ``device_audit``: under nccl-emu, device tensors told from host ones, and CUDA's mixing refused;
- ``emu_stream``: the emulation's in-order streams, one per communicator, and their calls;
- ``nccl_emu``: ``--backend nccl-emu``, gloo with NCCL's in-order streams on top.
"""
