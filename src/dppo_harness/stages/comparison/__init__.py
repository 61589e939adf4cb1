"""The paired comparison stage: both arms trained step by step from one shared initial state,
then scored by one frozen evaluator and decided by the plan's rule.

`run` holds the loop (`run_comparison`, top to bottom) and an arm's counted restore
(`train.restore.restore` plus its optimizer check). It reads the plan's `RunConfig`, plus what
`config` adds (the arms' order each step, per-step seeds, the errors). The rest are what the loop
calls: `wall_guard` (stop before a step would pass the wall budget), `state` (the resumable run
state and its checks), `step_rows` (one row per arm-step and the per-arm summaries), `resume` (what
a resumed session takes over, verified by hash), `evaluate` and `decision` (the scored checkpoints
and the verdict).
"""
