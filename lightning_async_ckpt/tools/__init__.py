"""Operator tools on top of the library: the command line, the backlog model and the timeline plot.

``cli`` (parser and dispatch, entry point ``main``), ``commands`` (``ls``/``verify``/``gc``),
``plan_commands`` (``plan``/``timeline``/``bench``), ``backlog`` (the fluid-queue model), ``planner`` (rates
measured from an event log; re-exports the model), ``timeline`` (the plot) and ``fmt`` (number formatting).
"""
