"""The framework-free pipeline: capture and proof, staging, admission, the engine, persist, telemetry.

Nothing here imports Lightning, Accelerate, argparse or matplotlib; it depends only on ``storage`` and ``errors``.
"""
