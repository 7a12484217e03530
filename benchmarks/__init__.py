"""Benchmarks of dejax_eqx against flashbax, dejax and a raw `jax.numpy` floor.

One entry point, `python -m benchmarks` (`__main__.py`: the plan, the per-process workers, the
report). `_harness.py` holds what every workload shares (items, timing, the subprocess runner,
machine info, result files); `uniform.py` (W1-W4), `trajectory.py` (W5) and `prioritised.py`
(W6) hold the workloads, as functions only. Workload modules import `_harness`, never the entry
point.
"""
