"""Write-once objects and leased claims: a stalled or live writer can never land bytes in another attempt's commit.

Two writers that share a host name but not a pid namespace (containers with the host's network) see each other's
pid as dead: only the lease (an expiry renewed while the writer writes) may prove a writer gone. A writer whose
lease expired while it was stalled (a zombie) may wake and write on: its bytes must land in an orphaned inode,
never in the objects the next attempt committed at the same names. Concurrency is ordered by the test itself
(the zombie's writes happen before or after the other writer's, in program order), never by sleeps.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_async_ckpt.errors import GenerationExistsError, StorageError
from lightning_async_ckpt.storage.io import open_local_write
from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.storage.writer import CLAIM_NAME, claim_body

CKPT = "checkpoint.ckpt"


def is_claim_name(name: str) -> bool:
    """A step claim (``.writer.json``) or an attempt claim (``.writer-<token>-r<rank>.json``)."""
    return name == CLAIM_NAME or (name.startswith(".writer-") and name.endswith(".json"))


def _dead_pid() -> int:
    """The pid of a process of this host that has exited (what another pid namespace's writer looks like)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _foreign_claim(folder: Path, *, expires: float, run_id: str = "other") -> dict:
    """A step claim of this host's name whose pid is dead here, with the given lease expiry."""
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "run_id": run_id,
        "step": 2,
        "token": "0123456789ab",
        "rank": 0,
        "host": socket.gethostname(),
        "pid": _dead_pid(),
        "started": time.time() - 10,
        "expires": expires,
    }
    (folder / CLAIM_NAME).write_text(json.dumps(body))
    return body


def _claims_of(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in folder.rglob("*") if p.is_file() and is_claim_name(p.name)]


def test_a_live_lease_is_not_taken_over_even_when_its_pid_is_dead_on_this_host(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000002"
    body = _foreign_claim(folder, expires=time.time() + 3600)
    (folder / CKPT).write_bytes(b"the live writer's bytes")
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(2)
    assert writer.prefix.startswith("w-")  # its own names: the live writer's are left alone
    writer.write_bytes(CKPT, b"second writer")
    writer.commit()
    assert (folder / CKPT).read_bytes() == b"the live writer's bytes"
    assert json.loads((folder / CLAIM_NAME).read_text()) == body
    assert store.verify(2).ok


def test_a_live_lease_keeps_retention_away_from_a_leftover_of_this_run(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), run_id="run")
    for step in (1, 3):
        store.begin(step).commit()
    folder = tmp_path / "step-00000002"
    _foreign_claim(folder, expires=time.time() + 3600, run_id="run")
    (folder / CKPT).write_bytes(b"in progress")
    report = store.retain(keep_last=1)
    assert report.removed == [1]
    assert [(r.step, "a live process" in r.reason) for r in report.refused] == [(2, True)]
    assert (folder / CKPT).exists()


def test_an_expired_lease_is_taken_over_and_its_leftovers_are_not_reused(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000002"
    _foreign_claim(folder, expires=time.time() - 3600)
    (folder / CKPT).write_bytes(b"the dead writer's partial bytes")
    store = CheckpointStore(str(tmp_path), run_id="run")
    writer = store.begin(2)
    assert writer.prefix == ""  # the step's plain names
    assert json.loads((folder / CLAIM_NAME).read_text())["token"] != "0123456789ab"
    writer.write_bytes(CKPT, b"new")
    writer.commit()
    assert store.open(2, CKPT).read() == b"new" and store.verify(2).ok


def test_an_expired_lease_is_removed_by_retention_of_this_run(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), run_id="run")
    for step in (1, 3):
        store.begin(step).commit()
    folder = tmp_path / "step-00000002"
    _foreign_claim(folder, expires=time.time() - 3600, run_id="run")
    (folder / CKPT).write_bytes(b"a crashed attempt")
    assert sorted(store.retain(keep_last=1).removed) == [1, 2]
    assert not folder.exists()


def test_every_writer_holds_a_leased_attempt_claim_until_it_ends(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(2)
    folder = tmp_path / "step-00000002"
    leases = [c for c in _claims_of(folder) if c["token"] == writer.token]
    assert leases and all(c["expires"] > time.time() for c in leases)
    assert (folder / f".writer-{writer.token}-r0.json").exists()
    writer.write_bytes(CKPT, b"x")
    writer.commit()
    assert not (folder / f".writer-{writer.token}-r0.json").exists()


def test_a_local_object_is_never_opened_where_a_file_exists(tmp_path: Path) -> None:
    path = tmp_path / "object.bin"
    path.write_bytes(b"committed")
    for direct_io in (True, False):
        with pytest.raises(FileExistsError):
            open_local_write(str(path), direct_io)
    assert path.read_bytes() == b"committed"


def _pretend_gone(folder: Path) -> None:
    """What the claims of a stalled writer (the only one so far) look like from another pid namespace once its
    lease expired: the pid is dead on this host and the expiry passed."""
    for path in folder.rglob("*"):
        if path.is_file() and is_claim_name(path.name):
            body = json.loads(path.read_text())
            path.write_text(json.dumps({**body, "pid": _dead_pid(), "expires": time.time() - 3600}))


def test_a_zombie_single_file_writer_never_lands_in_the_committed_object(tmp_path: Path) -> None:
    zombie_store = CheckpointStore(str(tmp_path), run_id="run")
    zombie = zombie_store.begin(2)
    stream = zombie.open(CKPT)
    stream.write(b"z" * 4096)  # the zombie's first part, then it stalls
    folder = tmp_path / "step-00000002"
    _pretend_gone(folder)

    store = CheckpointStore(str(tmp_path), run_id="run")
    writer = store.begin(2)
    assert writer.prefix == ""  # took the step over from the expired claim
    data = os.urandom(3 << 20)
    writer.write_bytes(CKPT, data)
    writer.commit()

    stream.write(b"Z" * (3 << 20))  # the zombie wakes up and writes on through its old descriptor
    stream.close()
    with pytest.raises((StorageError, GenerationExistsError)):
        zombie.commit()
    zombie.abort()
    assert store.verify(2).ok
    assert store.open(2, CKPT).read() == data


def test_a_zombie_that_opens_late_cannot_replace_a_committed_object(tmp_path: Path) -> None:
    zombie = CheckpointStore(str(tmp_path), run_id="run").begin(2)
    folder = tmp_path / "step-00000002"
    _pretend_gone(folder)
    store = CheckpointStore(str(tmp_path), run_id="run")
    writer = store.begin(2)
    writer.write_bytes(CKPT, b"committed")
    writer.commit()
    with pytest.raises(StorageError):
        zombie.open(CKPT)  # stalled before it opened: the name is taken, it is never truncated
    zombie.abort()
    assert store.open(2, CKPT).read() == b"committed" and store.verify(2).ok


def test_claim_bodies_carry_a_lease() -> None:
    body = json.loads(claim_body("run", 2, "abc", rank=3))
    assert body["rank"] == 3 and body["expires"] > body["started"]


def test_a_lease_renewal_pushes_the_expiry_and_a_removed_claim_is_never_recreated(tmp_path: Path) -> None:
    from lightning_async_ckpt.storage.claims import Liveness, token_liveness

    store = CheckpointStore(str(tmp_path))
    writer = store.begin(2)
    folder = tmp_path / "step-00000002"
    lease_file = folder / f".writer-{writer.token}-r0.json"
    lease_file.write_text(json.dumps({**json.loads(lease_file.read_text()), "expires": time.time() - 3600}))
    step_claim = json.loads((folder / CLAIM_NAME).read_text())
    (folder / CLAIM_NAME).write_text(json.dumps({**step_claim, "expires": time.time() - 3600}))
    assert token_liveness(store.location, str(folder), writer.token) is Liveness.EXPIRED
    writer.lease.renew(force=True)  # what a write does once RENEW_S passed
    assert token_liveness(store.location, str(folder), writer.token) is Liveness.LIVE
    lease_file.unlink()  # e.g. removed by an operator's gc
    writer.lease.renew(force=True)
    assert writer.lease.lost and not lease_file.exists()
    writer.abort()


def test_on_an_object_store_an_expired_claim_is_never_taken_over(s3_uri: tuple[str, dict]) -> None:
    uri, options = s3_uri
    store = CheckpointStore(uri, options)
    old = json.loads(claim_body("other", 2, "0123456789ab"))
    store.fs.pipe_file(f"{store.generation_path(2)}/{CLAIM_NAME}", json.dumps({**old, "expires": 0}).encode())
    writer = store.begin(2)
    # A frozen writer's multipart upload could still complete at a plain key: only unique keys are safe there.
    assert writer.prefix.startswith("w-")
    writer.write_bytes(CKPT, b"data")
    writer.commit()
    assert store.manifest(2).object(CKPT).key.startswith("w-") and store.verify(2).ok


def test_an_aborted_attempt_beside_foreign_files_never_lets_retention_delete_them(tmp_path: Path) -> None:
    # A step folder holding a file the library never wrote: the attempt writes beside it (under its own prefix)
    # and aborts. Its step must not then count as this store's failed attempt, or retention removes the folder.
    folder = tmp_path / "step-00000005"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    store = CheckpointStore(str(tmp_path))
    writer = store.begin(5)
    assert writer.prefix.startswith("w-")
    writer.write_bytes("a.bin", b"x")
    writer.abort()
    later = store.begin(10)
    later.write_bytes("a.bin", b"y")
    later.commit()
    store.retain(1)
    assert (folder / "notes.txt").read_text() == "mine"
