"""``ls`` / ``verify`` / ``gc --local-dirpath`` on the DCP local layout: ``<local_dirpath>[/v<k>]/rank-<r>`` stores
and ``replica-of-rank-<r>`` folders, each labelled with its holder and version, checked and collected.

The generations are written by the real ``TieredShardedCheckpointer`` in this one process (no process group: world
size 1 writes ``rank-0``). A replica folder is what a peer's receiver writes (rank 0's committed objects and manifest);
here it is laid out by copying rank 0's real generations, since receiving one needs a second gloo rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.tiered_sharded import TieredShardedCheckpointer
from lightning_async_ckpt.tools.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _write(local: str, durable: Path, steps: range, every: int | None) -> None:
    model = torch.nn.Linear(8, 8)
    ckpt = TieredShardedCheckpointer(local, str(durable), every_n_train_steps=every)
    try:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step, {"model": model.state_dict()})
        ckpt.drain()
    finally:
        ckpt.close()


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``local/rank-0``: steps 1-4 (2 and 4 promoted to ``durable``); ``local/v1/rank-0``: steps 5, 6 (not
    promoted); ``local/replica-of-rank-0``: copies of rank 0's steps 2 and 3."""
    base = tmp_path_factory.mktemp("dcp_tiers")
    local, durable = base / "local", base / "durable"
    _write(str(local), durable, range(1, 5), every=2)
    _write(str(local / "v1"), durable, range(5, 7), every=None)
    for step in (2, 3):
        name = f"step-{step:08d}"
        shutil.copytree(local / "rank-0" / name, local / "replica-of-rank-0" / name)
    return local, durable


def _copy(layout: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    local, durable = tmp_path / "local", tmp_path / "durable"
    shutil.copytree(layout[0], local)
    shutil.copytree(layout[1], durable)
    return local, durable


def _steps(uri: Path) -> list[int]:
    return [g.step for g in CheckpointStore(str(uri), check_writable=False).generations()]


def test_ls_lists_rank_and_replica_folders_with_their_labels(layout, capsys) -> None:
    local, durable = layout
    rc, out, _ = _run(capsys, "ls", str(durable), "--local-dirpath", str(local), "--json")
    assert rc == 0
    got = [(r["tier"], r["holder"], r["version"], r["rank"], r["step"], r["promoted"]) for r in json.loads(out)]
    assert got == [
        ("local", "rank-0", 0, 0, 1, "no"),
        ("durable", "-", 0, None, 2, "promoted"),
        ("local", "rank-0", 0, 0, 2, "yes"),
        ("local", "replica-of-rank-0", 0, 0, 2, "yes, replica"),
        ("local", "rank-0", 0, 0, 3, "no"),
        ("local", "replica-of-rank-0", 0, 0, 3, "no, replica"),
        ("durable", "-", 0, None, 4, "promoted"),
        ("local", "rank-0", 0, 0, 4, "yes"),
        ("local", "v1/rank-0", 1, 0, 5, "no"),
        ("local", "v1/rank-0", 1, 0, 6, "no"),
    ]
    rc, out, _ = _run(capsys, "ls", str(durable), "--local-dirpath", str(local))
    assert rc == 0
    assert out.splitlines()[0].split()[:4] == ["TIER", "PROMOTED", "STEP", "HOLDER"]
    assert "steps [1, 3, 5, 6]" in out and "10 committed" in out
    assert f"{local}/v1/rank-0/step-00000006" in out and f"{local}/replica-of-rank-0/step-00000003" in out


def test_verify_reports_a_flipped_byte_in_a_rank_folder(layout, tmp_path, capsys) -> None:
    local, durable = _copy(layout, tmp_path)
    rc, out, _ = _run(capsys, "verify", str(durable), "--local-dirpath", str(local))
    assert rc == 0, out
    assert "local rank-0 step 3: OK" in out and "local replica-of-rank-0 step 3: OK" in out
    assert "local v1/rank-0 step 6: OK" in out and "10 ok, 0 failed (both tiers)" in out
    [shard] = [p for p in (local / "rank-0" / "step-00000003").iterdir() if ".distcp" in p.name]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, out, err = _run(capsys, "verify", str(durable), "--local-dirpath", str(local))
    assert rc == 1 and "local/rank-0:3" in err
    assert "local rank-0 step 3: FAILED" in out and shard.name in out
    assert "local replica-of-rank-0 step 3: OK" in out  # the replica's own copy is intact
    rc, out, _ = _run(capsys, "verify", str(durable), "--local-dirpath", str(local), "--json")
    body = json.loads(out)
    assert rc == 1 and not body["ok"]
    failed = [(t.get("store"), t["failed"]) for t in body["tiers"] if t["failed"]]
    assert failed == [("rank-0", [3])]


def test_gc_keeps_what_retention_keeps(layout, tmp_path, capsys) -> None:
    local, durable = _copy(layout, tmp_path)
    argv = ("gc", str(durable), "--local-dirpath", str(local), "--keep-last", "1")
    rc, out, _ = _run(capsys, *argv, "--dry-run")
    assert rc == 0, out
    assert "would remove step 3" in out and "kept steps [5, 6]" in out
    assert _steps(local / "rank-0") == [1, 2, 3, 4] and _steps(local / "replica-of-rank-0") == [2, 3]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0, out
    assert _steps(durable) == [4]
    assert _steps(local / "rank-0") == [4]
    # Newer than the durable tier's newest: possibly due and not promoted yet, never removed.
    assert _steps(local / "v1" / "rank-0") == [5, 6]
    # A replica folder: --keep-last only, as the replicator applies it.
    assert _steps(local / "replica-of-rank-0") == [3]
