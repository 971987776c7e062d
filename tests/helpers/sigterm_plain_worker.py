"""Subprocess side of the plain-loop SIGTERM test: the README's loop, SIGTERM arriving while a save uploads.

``python _sigterm_plain_worker.py <dir> default|drain``: ``default`` leaves SIGTERM's default action (the process
ends at once); ``drain`` installs the README's handler (SIGTERM becomes ``SystemExit`` inside the ``with`` block,
whose exit drains). The upload of step 20 sends SIGTERM to its own process at its first write and is
bandwidth-capped so it is still in flight when the signal lands.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from lightning_async_ckpt import AsyncCheckpointer, CheckpointStore  # noqa: E402
from lightning_async_ckpt.testing import (
    Fault,  # noqa: E402
    register_faulty,
)

register_faulty()  # this process names faulty:// URLs


def main(root: str, mode: str) -> None:
    if mode == "drain":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the README's line
    kill = Fault(op="write", path="step-00000020", callback=lambda _call: os.kill(os.getpid(), signal.SIGTERM))
    options = {"target_protocol": "file", "faults": [kill], "bandwidth_bps": 4_000_000}
    store = CheckpointStore(f"faulty://{root}", options)
    model = torch.nn.Linear(512, 512)  # 1 MB of weights, 2 MB of Adam state: about 0.75 s per upload
    optimizer = torch.optim.Adam(model.parameters())
    with AsyncCheckpointer(store).attach(model, optimizer) as ckpt:
        for step in range(1, 41):
            model(torch.randn(4, 512)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 10 == 0:
                ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
