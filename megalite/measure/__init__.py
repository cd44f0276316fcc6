"""Measuring a run against the planner's predictions: the part of megalite that runs real steps.

- ``first_step.FirstStepComparison``: the planner's prediction for the run's own layout beside
  what the first training step measured (a ``FirstStepHook``; ``pretrain_gpt.py`` registers it);
- ``saved_tensors.SavedTensorMeter``: the activations autograd keeps for backward, counted with
  saved-tensor hooks (``measure_step``: one step of a trainer under it);
- ``live_bytes.LivePeak``: the most bytes of tensors created in a block alive at once (CPU's
  stand-in for the allocator's peak);
- ``comm_log.CommLog``: the collectives and messages a rank issues, by op, group size and bytes.

It sits above ``training`` and ``planning`` (it imports both) and nothing in megalite imports it:
``planning`` stays arithmetic over a layout and ``training`` knows nothing of the planner.
"""
