"""Deployed models: a model's request queue and batches (``models``, ``batching``) and the hub
that runs due batches on the dispatcher thread between training steps (``hub``)."""
