"""``python -m lightning_async_ckpt``: the same command line as ``lightning-async-ckpt``."""

from __future__ import annotations

import sys

from lightning_async_ckpt.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
