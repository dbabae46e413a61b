"""Benchmarks: :mod:`.harness` (the one measurement harness every script under ``benchmarks/``
uses) and :mod:`.sharing` (``xshare bench``: xshare vs exclusive allocation vs one process per
job). Importing this package imports neither jax nor the harness's optional dependencies."""
