"""Operator tools on top of the library: the command line, the models and the timeline plot."""
