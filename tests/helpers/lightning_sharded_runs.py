"""The Lightning sharded two-tier and replica fits, launched once per kind per pytest session and shared by
``tests/lightning/test_tiers_sharded.py`` and ``tests/lightning/test_replicas_sharded.py``.

Both parts (``tiers``, ``replicas``) run in one 2-rank launch of
``tests/helpers/lightning_sharded_tiers_replicas_worker.py`` per kind (``mp``, ``sliced``): the ranks' start and the
uninterrupted reference fit are paid once for both test modules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.dist import launch_ranks

WORKER = Path(__file__).resolve().parent / "lightning_sharded_tiers_replicas_worker.py"
PARTS = ("tiers", "replicas")
#: One launch: the reference fit and both parts' fits (~10-15 s warm at load 5).
LAUNCH_TIMEOUT_S = 280

_launched: dict[str, tuple[dict[str, list[dict]], list[int], str]] = {}


def ranks(kind: str, part: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's result (ordered by rank) of ``part`` of the ``kind`` launch, launching it on first use."""
    if kind not in _launched:
        out = tmp_path_factory.mktemp(f"lightning_sharded_{kind}")
        procs = launch_ranks([sys.executable, str(WORKER), str(out), kind, ",".join(PARTS)], timeout=LAUNCH_TIMEOUT_S)
        results: dict[str, list[dict]] = {}
        for proc in procs:
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    _, name, body = line.split(" ", 2)
                    results.setdefault(name, []).append(json.loads(body))
        stderr = "\n".join(p.stderr[-4000:] for p in procs)
        _launched[kind] = (results, [p.returncode for p in procs], stderr)
    results, codes, stderr = _launched[kind]
    assert codes == [0, 0], stderr  # every part and the ranks' exit
    got = sorted(results.get(part, []), key=lambda r: r["rank"])
    assert len(got) == 2, f"{kind} {part}: {len(got)} rank results\n{stderr}"
    return got
