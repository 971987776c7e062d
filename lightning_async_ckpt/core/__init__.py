"""The framework-free pipeline, one module per role.

``proof``/``capture``/``guard`` (what is copied at the cut and what may wait, and the runtime check),
``staging`` (host buffers and the background copy), ``admission`` (one decision per request), ``engine`` (save,
wait, drain), ``completion`` (how a save ends: commit, outcomes, the error queue), ``persist`` (serialize and
write with a retry policy, through the I/O pump), ``lifecycle`` (close, the exit drain, pre-allocation),
``workers`` (named threads and the one interpreter-exit trampoline), ``hooks`` (fences for plain loops),
``options``, ``telemetry`` (records and the event schema, written and read), ``handle`` and ``collective``.

Nothing here imports Lightning, Accelerate, argparse or matplotlib; it depends only on ``storage`` and ``errors``.
"""
