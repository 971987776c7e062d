"""One rank of the Lightning sharded two-tier and peer-replica tests (``tests/lightning/test_tiers_sharded.py``,
``tests/lightning/test_replicas_sharded.py``) on 2 CPU ranks (gloo).

Usage: ``python lightning_sharded_tiers_replicas_worker.py <out> <kind> <part>[,<part>...]`` under
``tests.helpers.dist.launch_ranks``. ``kind``: ``mp`` (``ModelParallelStrategy``, FSDP2) or ``sliced``
(``DDPStrategy`` with ``ddp_layout="sliced"``). One uninterrupted 12-step fit (the reference both parts compare
with), then each part in ``<out>/<part>``: ``tiers`` (``sharded_tiers_lightning_worker.run_tiers``) and ``replicas``
(``lightning_sharded_replicas_worker.run_replicas``). Prints ``RESULT <part> {json}`` after each part.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.lightning_sharded_replicas_worker import run_replicas  # noqa: E402
from tests.helpers.sharded_tiers_lightning_worker import Record, _fit, run_tiers  # noqa: E402

PARTS = {"tiers": run_tiers, "replicas": run_replicas}


def main(out: str, parts: list[str]) -> None:
    record = Record({12})
    _fit([record], 12)
    for part in parts:
        result = PARTS[part](f"{out}/{part}", record)
        print(f"RESULT {part} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[3].split(","))  # sys.argv[2] (the kind) is read by sharded_tiers_lightning_worker
