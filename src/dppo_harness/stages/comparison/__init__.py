"""The paired comparison stage: both arms trained step by step from one shared initial state,
then scored by one frozen evaluator and decided by the plan's rule.

Modules, in the order the run uses them: `config` (the paired schedule of a plan and the
per-step sampling seeds), `wall_guard` (stop before a step would pass the wall budget),
`state` (the resumable run state and its resume checks), `step_rows` (one row per arm-step and
the per-arm summaries), `arms` (one arm-step, its capacity-retry guard, and `train_arms`),
`restore` (an arm's client from its saved state, counted and optimizer-checked),
`resume` (what a resumed session takes over, verified by hash), `evaluate` and `decision`
(the scored checkpoints and the verdict), `run_steps` (the run's evidence steps) and `run`
(`run_comparison`, the stage's named steps in order).
"""
