"""A missing optional backend is a clear error naming the extra to install, raised before anything is written."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_s3_without_s3fs_names_the_extra():
    # A fresh interpreter in which importing s3fs fails, as on a machine without the `s3` extra.
    script = textwrap.dedent(
        """
        import builtins
        real_import = builtins.__import__
        def no_s3fs(name, *args, **kwargs):
            if name == "s3fs" or name.startswith("s3fs."):
                raise ImportError("No module named 's3fs'")
            return real_import(name, *args, **kwargs)
        builtins.__import__ = no_s3fs
        from lightning_async_ckpt.errors import ConfigError
        from lightning_async_ckpt.storage.store import CheckpointStore
        try:
            CheckpointStore("s3://bucket/prefix")
        except ConfigError as exc:
            print("ERROR", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ERROR" in out.stdout, out.stderr[-2000:]
    assert "lightning_async_ckpt[s3]" in out.stdout and "s3://bucket/prefix" in out.stdout
