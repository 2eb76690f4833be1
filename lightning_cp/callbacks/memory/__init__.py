"""The parts of :class:`~lightning_cp.callbacks.MemoryProfilerCallback`, one job each.

- :mod:`.schedule`: which steps (windows) and ranks record, parsed from the callback's options;
- :mod:`.recording`: the CUDA allocator's history on and off, and the out-of-memory observer;
- :mod:`.tensors`: what the blocks hold, the byte ranges of the module's and optimizers' tensors;
- :mod:`.timeline`: a snapshot replayed into allocated / reserved memory by category over its trace;
- :mod:`.report`: the offline markdown and PNG of a timeline (matplotlib only there, lazily);
- :mod:`.dump`: the files of one snapshot (pickle, report, PyTorch's HTML) and their names;
- :mod:`.peaks`: the per-step peak memory the callback logs.
"""
