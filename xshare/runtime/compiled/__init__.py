"""What is compiled: a job's step lowered and compiled once per program (``compiler``,
``program``, ``lifting``, ``leaves``), fused groups' vmapped programs (``fusion``, ``sweeps``),
K-step programs (``multistep``) and eval programs (``eval_programs``). Runs on the compile pool
and the tier thread; hands the engine plain data (``Program``, ``MultiStep``)."""
