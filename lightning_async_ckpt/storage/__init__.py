"""Where checkpoints live: the manifest, low-level I/O, the generation writer, the store and retention.

Depends only on fsspec and ``errors``; knows nothing of capture, staging or any training framework.
"""
