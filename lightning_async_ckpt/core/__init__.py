"""The framework-free pipeline, one module per role (``docs/architecture.md`` lists them).

Nothing here imports Lightning, Accelerate, argparse or matplotlib; it depends only on ``storage`` and ``errors``.
"""
