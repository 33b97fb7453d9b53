"""pliant.worker.inplace: the in-place world of a worker under ``pliant run --rescale in-place``.

A script never imports from here; :class:`pliant.worker.Session` builds it. The modules, by concept:

- :mod:`~pliant.worker.inplace.world`: the :class:`~pliant.worker.inplace.world.World`, one generation's membership
  in this process (its env, process group and sockets, the directive; forming and retiring).
- :mod:`~pliant.worker.inplace.protocol`: the rescale protocol, the runner of every engine step (boundary, vote,
  commit, recovery from a peer's failure, re-forming).
- :mod:`~pliant.worker.inplace.transfer`: the state transfer to a new world, and the roll back of a sharded engine.
- :mod:`~pliant.worker.inplace.buddy` (with :mod:`~pliant.worker.inplace.kept` and
  :mod:`~pliant.worker.inplace.packing`): the sharded engines' buddy copies, in memory and in files that outlive the
  process.
- :mod:`~pliant.worker.inplace.cadence`: when ranks vote and snapshot.
- :mod:`~pliant.worker.inplace.guard`: the step guard, which breaks a step a dead or cut-off peer blocks.
- :mod:`~pliant.worker.inplace.groups`: process groups' sockets, stores and rendezvous, at the level of sockets.
- :mod:`~pliant.worker.inplace.nccl`: the device plan, and what NCCL needs to fail a step instead of hanging it.
- :mod:`~pliant.worker.inplace.setup_window`: the rule that a script runs no collective of its own before its loop.
"""
