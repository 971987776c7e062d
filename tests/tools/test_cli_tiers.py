"""``ls`` / ``verify`` / ``gc`` with ``--local-dirpath``: both tiers, each generation labelled with its tier and
whether it was promoted (a real two-tier store written by ``TieredCheckpointer``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tiers.tiered import TieredCheckpointer
from lightning_async_ckpt.tools.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, Path]:
    """Local steps 1, 2, 3, 4; steps 2 and 4 promoted to the durable tier."""
    local, durable = tmp_path / "local", tmp_path / "durable"
    model = torch.nn.Linear(8, 8)
    with TieredCheckpointer(str(local), str(durable), every_n_train_steps=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, {"model": model.state_dict()}, defer=False)
        ckpt.drain()
    return local, durable


def test_ls_shows_both_tiers_labelled_promoted_or_not(tiers, capsys) -> None:
    local, durable = tiers
    rc, out, _ = _run(capsys, "ls", str(durable), "--local-dirpath", str(local), "--json")
    assert rc == 0
    rows = json.loads(out)
    got = [(r["tier"], r["step"], r["promoted"]) for r in rows]
    assert got == [
        ("local", 1, "no"),
        ("durable", 2, "promoted"),
        ("local", 2, "yes"),
        ("local", 3, "no"),
        ("durable", 4, "promoted"),
        ("local", 4, "yes"),
    ]
    rc, out, _ = _run(capsys, "ls", str(durable), "--local-dirpath", str(local))
    assert rc == 0
    header = out.splitlines()[0].split()
    assert header[:3] == ["TIER", "PROMOTED", "STEP"]
    assert "local only (not on" in out and "steps [1, 3]" in out
    assert "6 committed" in out
    # Without the flag: the durable tier only, as before.
    rc, out, _ = _run(capsys, "ls", str(durable), "--json")
    assert [r["step"] for r in json.loads(out)] == [2, 4]


def test_ls_with_the_local_tier_lost_lists_the_durable_one(tiers, capsys) -> None:
    local, durable = tiers
    shutil.rmtree(local)
    rc, out, err = _run(capsys, "ls", str(durable), "--local-dirpath", str(local), "--json")
    assert rc == 0 and "no local tier at" in err
    assert [(r["tier"], r["step"]) for r in json.loads(out)] == [("durable", 2), ("durable", 4)]


def test_verify_checks_both_tiers_and_names_the_damaged_one(tiers, capsys) -> None:
    local, durable = tiers
    rc, out, _ = _run(capsys, "verify", str(durable), "--local-dirpath", str(local))
    assert rc == 0, out
    assert "durable step 2: OK" in out and "local step 3: OK" in out
    assert "local step 4: OK" in out and out.split("local step 4: OK")[1].splitlines()[0].endswith("[promoted]")
    assert "6 ok, 0 failed (both tiers)" in out
    obj = CheckpointStore(str(local), check_writable=False).object_url(3, "checkpoint.ckpt")
    data = bytearray(Path(obj).read_bytes())
    data[40] ^= 0xFF
    Path(obj).write_bytes(bytes(data))
    rc, out, err = _run(capsys, "verify", str(durable), "--local-dirpath", str(local), "--json")
    assert rc == 1 and "local:3" in err
    body = json.loads(out)
    assert not body["ok"]
    by_tier = {t["tier"]: t for t in body["tiers"]}
    assert by_tier["durable"]["ok"] and by_tier["local"]["failed"] == [3]
    assert [r["promoted"] for r in by_tier["local"]["results"]] == [False, True, False, True]
    # A step held by only one tier is not bad input; one held by neither is.
    rc, out, _ = _run(capsys, "verify", str(durable), "--local-dirpath", str(local), "--step", "1")
    assert rc == 0 and "local step 1: OK" in out
    rc, _, err = _run(capsys, "verify", str(durable), "--local-dirpath", str(local), "--step", "9")
    assert rc == 2 and "nothing to verify" in err


def test_gc_collects_both_tiers(tiers, capsys) -> None:
    local, durable = tiers
    rc, out, _ = _run(capsys, "gc", str(durable), "--local-dirpath", str(local), "--keep-last", "1")
    assert rc == 0, out
    assert "== durable tier:" in out and "== local tier:" in out
    assert [g.step for g in CheckpointStore(str(durable), check_writable=False).generations()] == [4]
    assert [g.step for g in CheckpointStore(str(local), check_writable=False).generations()] == [4]
