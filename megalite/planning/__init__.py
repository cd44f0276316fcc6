"""The planner: predicted memory and step time of any layout, and the search over layouts.

Pure arithmetic on the model config and the layout: no tensors, no process groups, no run.
What measures real steps against it lives above it (``megalite.measure``: the first-step
comparison, saved-tensor and collective counters) and in ``tools/planner`` (this machine's
calibration, the step-time accuracy harness). ``tools/plan.py`` is the command line;
docs/PLANNER.md the user guide.
"""
