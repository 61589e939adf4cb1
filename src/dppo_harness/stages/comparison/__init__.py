"""The paired comparison stage: both arms trained step by step from one shared initial state
(`run`), then scored by one frozen evaluator (`evaluate`) and decided by the plan's rule (`decision`)."""
