"""The planner's measuring harnesses, run by ``tools/plan.py --calibrate``, the planner's tests
and ``tools/bench/bench_planner.py``: this machine's figures (``calibrate``, ``calibrate_comm``)
and the step time of real runs against the prediction (``accuracy``). Each runs inside a gloo
world and names the group of every collective it issues (``world_group``)."""
