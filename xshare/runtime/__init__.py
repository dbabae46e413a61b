"""The runtime: one process that owns a device and runs many jobs on it.

``runtime.py`` is the facade (``xshare.Runtime``); its parts live in sub-packages, in the order
data flows through them (docs/explanation/architecture.md):

* ``compiled``  what is compiled: a job's step lowered once per program, fused groups' programs,
  K-step programs, eval programs;
* ``engine``    the dispatcher thread and the parts it composes: which unit steps next, steps in
  flight, admission into the arena, fused groups, how jobs end;
* ``deployed``  deployed models, batched between training steps;
* ``observe``   what leaves the engine: metrics rows, checkpoints, snapshots, device timing;
* ``web``       the HTTP and gRPC servers over the facade.
"""
