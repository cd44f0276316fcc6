"""The planner: predicted memory and step time of any layout, and the search over layouts.

Pure arithmetic on the model config and the layout (no tensors, no process groups), except
``measure`` (the figures the predictions are checked against) and ``calibrate`` (this machine's
throughputs). ``tools/plan.py`` is the command line; docs/PLANNER.md the user guide.
"""
