"""A writer killed mid-upload: ``python tests/helpers/interrupted_upload.py URI OPTIONS_JSON RUN_ID STEP``.

It begins generation ``STEP`` of the S3 store, streams more than one multipart block into its object (so a
multipart upload is open with a part uploaded), prints ``uploading`` and waits on stdin until it is killed.
"""

from __future__ import annotations

import json
import sys

from lightning_async_ckpt.storage.store import CheckpointStore

BLOCK = 5 << 20  # S3's smallest part


def main() -> None:
    uri, options, run_id, step = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    store = CheckpointStore(uri, options, run_id=run_id, block_size=BLOCK)
    writer = store.begin(step)
    stream = writer.open("checkpoint.ckpt")
    stream.write(b"x" * (BLOCK + (1 << 20)))  # more than a block: s3fs opened the upload and sent a part
    print("uploading", flush=True)
    sys.stdin.read()  # killed here (SIGKILL): no abort, no cleanup


if __name__ == "__main__":
    main()
