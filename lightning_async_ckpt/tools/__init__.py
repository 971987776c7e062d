"""Operator tools on top of the library: the command line, the backlog model and the timeline plot."""
