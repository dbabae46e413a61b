"""What leaves the engine for people and files: the recorder thread (``recorder``) with its
metrics writers, checkpoints (``checkpoint``), snapshots and their schema (``snapshot``,
``schema``), Prometheus metrics, device timing from the FFI fences (``timing``) and NVML."""
