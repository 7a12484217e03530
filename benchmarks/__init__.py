"""Benchmarks of dejax_eqx against flashbax, dejax and a raw `jax.numpy` floor.

One entry point, `python -m benchmarks` (`__main__.py`: the plan, the per-process workers, the
report). `_harness.py` holds what every workload shares (items, timing, the subprocess runner,
machine info, result files, and the calls whose form changed between dejax_eqx versions);
`uniform.py` (W1-W4), `trajectory.py` (W5), `prioritised.py` (W6), `sequences.py` (W7),
`prioritised_sequences.py` (W8), `flashbax_dropin.py` (W9), `actor_add.py` (W10),
`datasets.py` (W11), `dispatch.py` (W12), `stoix_steps.py` (W13) and `check_cost.py` (W14)
hold the workloads, as functions only. Workload modules import `_harness`, never the entry point.
"""
