"""The command line, run in-process through ``main([...])`` and once as ``python -m lightning_async_ckpt``."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from lightning_async_ckpt.storage.store import CheckpointStore
from lightning_async_ckpt.tools.cli import main

CKPT = "checkpoint.ckpt"


# -- helpers ----------------------------------------------------------------------------------------------
def _commit(store: CheckpointStore, step: int, payload: bytes | None = None) -> None:
    writer = store.begin(step)
    writer.write_bytes(CKPT, payload if payload is not None else bytes(range(256)) * (step + 1))
    writer.write_bytes("extra/meta.bin", b"meta %d" % step)
    writer.commit(cut={"step": step})


def _leftover(store: CheckpointStore, step: int) -> None:
    """A generation whose writer died before the manifest (an uncommitted leftover)."""
    writer = store.begin(step)
    writer.write_bytes(CKPT, b"half written")
    store.end_write(step)  # the dead writer no longer holds it; a fresh CLI process would not know it anyway


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    """A local store: committed steps 10, 20, 30 and an uncommitted leftover at step 5."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root), run_id="run-a")
    for step in (10, 20, 30):
        _commit(store, step)
    _leftover(store, 5)
    return root


def _flip_byte(path: Path, offset: int = 17) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- ls -------------------------------------------------------------------------------------------------------
def test_ls_table_and_json(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "ls", str(store_dir))
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["STEP", "STATE", "SIZE", "OBJECTS", "AGE"]
    rows = {line.split()[0]: line for line in lines[1:5]}
    assert rows["5"].split()[1] == "uncommitted" and rows["30"].split()[1] == "committed"
    assert "run-a" in rows["30"] and rows["30"].rstrip().endswith("step-00000030")
    assert "3 committed" in lines[-1] and "1 not committed" in lines[-1]

    rc, out, _ = _run(capsys, "ls", str(store_dir), "--json")
    assert rc == 0
    body = json.loads(out)
    assert [(g["step"], g["committed"]) for g in body] == [(5, False), (10, True), (20, True), (30, True)]
    assert body[3]["bytes"] == 256 * 31 + len(b"meta 30") and body[3]["objects"] == 2
    assert body[3]["age_s"] >= 0


def test_ls_empty_store_folder_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    rc, out, err = _run(capsys, "ls", str(tmp_path / "empty"))
    assert rc == 0 and out == "" and "no generations" in err


def test_ls_on_a_wrong_path_exits_2_with_a_clear_message(
    store_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(capsys, "ls", str(tmp_path / "nothing-here"))
    assert rc == 2 and out == "" and "does not exist" in err and "Traceback" not in err
    rc, _, err = _run(capsys, "ls", str(tmp_path / "nothing-here"), "--json")
    assert rc == 2 and "does not exist" in err
    (tmp_path / "a-file").write_text("x")
    rc, _, err = _run(capsys, "ls", str(tmp_path / "a-file"))
    assert rc == 2 and "is a file, not a store folder" in err
    # The parent of a store (runs/ instead of runs/demo) names the subfolder that holds the generations.
    rc, _, err = _run(capsys, "ls", str(store_dir.parent))
    assert rc == 2 and "subfolders hold some: ckpt" in err and len(err.strip().splitlines()) == 1


def test_ls_on_a_missing_memory_prefix_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "ls", "memory://no-such-bucket/run")
    assert rc == 2 and "does not exist" in err


# -- verify ---------------------------------------------------------------------------------------------------
def test_verify_all_committed(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "verify", str(store_dir))
    assert rc == 0, err
    assert "step 10: OK" in out and "step 30: OK" in out
    assert "skipped uncommitted" in out and "[5]" in out
    assert "3 ok, 0 failed" in out


def test_verify_detects_a_flipped_byte(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_byte(store_dir / "step-00000020" / CKPT)
    rc, out, err = _run(capsys, "verify", str(store_dir))
    assert rc == 1
    assert "step 20: FAILED" in out and f"{CKPT}: checksum" in out
    assert "step 10: OK" in out and "step 30: OK" in out
    assert "steps [20]" in err and "Traceback" not in err

    rc, out, _ = _run(capsys, "verify", str(store_dir), "--step", "20", "--json")
    assert rc == 1
    body = json.loads(out)
    assert body["ok"] is False and body["results"][0]["step"] == 20 and body["results"][0]["problems"]

    rc, _, _ = _run(capsys, "verify", str(store_dir), "--step", "30")
    assert rc == 0


def test_verify_reports_missing_object_and_rejected_manifest(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (store_dir / "step-00000010" / "extra" / "meta.bin").unlink()
    (store_dir / "step-00000030" / "manifest.json").write_text("{not json")
    rc, out, _ = _run(capsys, "verify", str(store_dir))
    assert rc == 1
    assert "step 10: FAILED" in out and "extra/meta.bin: missing" in out
    assert "step 30: FAILED" in out and "not valid JSON" in out
    assert "step 20: OK" in out


def test_verify_uncommitted_step_fails_and_missing_step_is_bad_input(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = _run(capsys, "verify", str(store_dir), "--step", "5")
    assert rc == 1 and "step 5: FAILED" in out and "not committed" in out
    rc, _, err = _run(capsys, "verify", str(store_dir), "--step", "999")
    assert rc == 2 and "no generation for step(s) [999]" in err and "10, 20, 30" in err


# -- gc -------------------------------------------------------------------------------------------------------
def test_gc_dry_run_then_collect(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "2", "--dry-run")
    assert rc == 0
    assert "would remove step 5 (uncommitted leftover)" in out and "would remove step 10 (committed" in out
    assert sorted(p.name for p in store_dir.iterdir() if p.name.startswith("step-")) == [
        "step-00000005",
        "step-00000010",
        "step-00000020",
        "step-00000030",
    ]
    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "2")
    assert rc == 0 and "removed 2 generation(s); committed steps kept: [20, 30]" in out
    assert [g.step for g in CheckpointStore(str(store_dir)).generations(include_uncommitted=True)] == [20, 30]
    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "2")
    assert rc == 0 and "removed 0 generation(s)" in out


def test_gc_with_several_runs_asks_which(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = CheckpointStore(str(store_dir), run_id="run-b")
    _commit(other, 40)
    rc, _, err = _run(capsys, "gc", str(store_dir), "--keep-last", "1")
    assert rc == 2 and "2 runs" in err and "--all-runs" in err and "--run-id" in err

    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "1", "--run-id", "run-b", "--dry-run")
    assert rc == 0 and "step 10" not in out and "would remove step 5" not in out  # run-b's only step is kept
    # run-a's uncommitted leftover may be run-a's save in progress: run-b's retention never removes it, and says so.
    assert "kept step 5: uncommitted, written by run-a" in out

    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "2", "--run-id", "run-a")
    assert rc == 0  # keep_last counts run-a's own generations: run-b's newer commit does not evict them
    assert [g.step for g in CheckpointStore(str(store_dir)).generations()] == [20, 30, 40]

    rc, out, _ = _run(capsys, "gc", str(store_dir), "--keep-last", "1", "--all-runs")
    assert rc == 0 and "committed steps kept: [40]" in out


# -- plan -----------------------------------------------------------------------------------------------------
def test_plan_json_worked_cases(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--arrival-rate", "2", "--drain-rate", "3", "--backlog", "4", "--json")
    assert rc == 0
    body = json.loads(out)
    assert body["net_rate"] == -1.0 and body["drain_time"] == 4.0 and body["sustainable"] is True

    rc, out, _ = _run(capsys, "plan", "--arrival-rate", "4", "--drain-rate", "3", "--backlog", "4", "--json")
    body = json.loads(out)
    assert rc == 0 and body["net_rate"] == 1.0 and body["drain_time"] is None

    rc, out, _ = _run(capsys, "plan", "--arrival-rate", "4", "--drain-rate", "3", "--backlog", "4", "--horizon", "6")
    assert rc == 0 and "drain time                     never" in out and "10 units" in out  # 4 + 1 * 6


def test_plan_bytes_mode_with_units(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--bytes", "10GiB", "--interval", "300", "--bandwidth", "20MB/s", "--json")
    body = json.loads(out)
    assert rc == 0
    assert body["bytes_per_checkpoint"] == 10 * 1024**3 and body["drain_rate"] == 20e6
    assert body["min_interval_s"] == pytest.approx(10 * 1024**3 / 20e6)
    assert body["sustainable"] is False and body["admission"] == "coalesce"
    rc, out, _ = _run(capsys, "plan", "--bytes", "1GB", "--interval", "600", "--bandwidth", "100MB/s")
    assert rc == 0 and "sustainable                    yes" in out and "recommended admission          wait" in out


def _engine_log(tmp_path: Path) -> Path:
    """A real event log: a few saves through the engine, with train_step events from the 'loop'."""
    import torch

    from lightning_async_ckpt.core.engine import AsyncCheckpointer

    log = tmp_path / "events.jsonl"
    model = torch.nn.Linear(8, 4)
    with AsyncCheckpointer(CheckpointStore(str(tmp_path / "run")), event_log=str(log)) as ckpt:
        for step in range(1, 9):
            ckpt.events.emit("train_step", step=step)
            if step % 2 == 0:
                ckpt.save(step, {"model": model.state_dict()}, defer=False)
        ckpt.drain()
    return log


def test_plan_and_timeline_from_a_real_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log = _engine_log(tmp_path)
    rc, out, err = _run(capsys, "plan", "--events", str(log), "--json")
    assert rc == 0, err
    body = json.loads(out)
    assert body["source"] == "events" and body["measured"]["requests"] == 4 and body["drain_rate"] > 0
    png = tmp_path / "timeline.png"
    rc, out, err = _run(capsys, "timeline", str(log), "-o", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_timeline_synthetic_log_with_failures_and_skips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    events: list[dict[str, Any]] = [{"event": "train_step", "t": 100.0 + i, "step": i} for i in range(10)]
    for i, outcome in enumerate(("committed", "skipped", "failed", "committed")):
        t = 101.0 + 2 * i
        events.append({"event": "request", "t": t, "step": i, "decision": "admit", "backlog": 0})
        phases = {
            "cut": [t, t + 0.1],
            "staging": [t, t + 0.3],
            "upload": [t + 0.3, t + 1.5],
            "commit": [t + 1.5, t + 1.6],
        }
        events.append(
            {
                "event": "save",
                "t": t + 1.7,
                "requested_step": i,
                "outcome": outcome,
                "t_request": t,
                "committed_step": i if outcome == "committed" else None,
                "phases": {} if outcome == "skipped" else phases,
            }
        )
    events.append({"event": "fence_wait", "t": 103.0, "wait_s": 0.2})
    log = tmp_path / "synthetic.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    png = tmp_path / "out.png"
    rc, _, err = _run(capsys, "timeline", str(log), "-o", str(png))
    assert rc == 0, err
    assert png.stat().st_size > 10_000


# -- bench dispatch -------------------------------------------------------------------------------------------
def test_bench_passes_remaining_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("lightning_async_ckpt_bench")
    fake.__spec__ = importlib.machinery.ModuleSpec("lightning_async_ckpt_bench", loader=None)
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning_async_ckpt_bench", fake)
    assert main(["bench", "--size", "1MB", "--json"]) == 0
    assert seen == [["--size", "1MB", "--json"]]

    def exits(argv: list[str]) -> int:
        raise SystemExit(3)  # what its own argparse does on --help or a usage error

    fake.main = exits  # type: ignore[attr-defined]
    assert main(["bench", "--help"]) == 3


def test_bench_rejects_unknown_modes_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "bench", "--modes", "none,teleport")
    assert rc == 2 and "teleport" in err and "Traceback" not in err


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "nosuchscheme://bucket/x"],
        ["verify", "{tmp}/empty"],
        ["plan", "--arrival-rate", "-1", "--drain-rate", "3"],
        ["plan", "--bytes", "1GB", "--interval", "0", "--bandwidth", "1MB/s"],
        ["plan", "--bytes", "lots", "--interval", "1", "--bandwidth", "1MB/s"],
        ["plan"],
        ["plan", "--arrival-rate", "1", "--drain-rate", "2", "--events", "x.jsonl"],
        ["plan", "--events", "{tmp}/missing.jsonl"],
        ["plan", "--events", "{tmp}/bad.jsonl"],
        ["timeline", "{tmp}/bad.jsonl"],
        ["gc", "{tmp}", "--keep-last", "0"],
        ["ls", "{tmp}", "--storage-option", "novalue"],
        ["frobnicate"],
    ],
)
def test_bad_input_exits_2_without_traceback(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"event": "request", "t": 1}\nnot json\n{"event": "x", "t": 2}\n')
    rc, _, err = _run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert rc == 2
    assert "Traceback" not in err
    assert "error:" in err
    assert len(err.strip().splitlines()) == 1


def test_python_dash_m_in_a_subprocess(store_dir: Path) -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_async_ckpt",
            "plan",
            "--arrival-rate",
            "2",
            "--drain-rate",
            "3",
            "--backlog",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["drain_time"] == 4.0
    _flip_byte(store_dir / "step-00000010" / CKPT)
    bad = subprocess.run(
        [sys.executable, "-m", "lightning_async_ckpt", "verify", str(store_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1 and "step 10: FAILED" in bad.stdout and "Traceback" not in bad.stderr


# -- S3 -------------------------------------------------------------------------------------------------------
def _s3_flags(options: dict[str, Any]) -> list[str]:
    flags = []
    for key, value in options.items():
        flags += ["--storage-option", f"{key}={value}"]
    return flags


def test_ls_and_verify_on_s3(s3_uri: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    uri, options = s3_uri
    store = CheckpointStore(uri, options, run_id="s3-run")
    for step in (1, 2):
        _commit(store, step)
    flags = _s3_flags(options)

    rc, out, err = _run(capsys, "ls", uri, *flags, "--json")
    assert rc == 0, err
    body = json.loads(out)
    assert [(g["step"], g["committed"], g["run_id"]) for g in body] == [(1, True, "s3-run"), (2, True, "s3-run")]
    assert body[0]["path"].startswith("s3://")

    rc, out, err = _run(capsys, "verify", uri, *flags)
    assert rc == 0 and "2 ok, 0 failed" in out, err

    key = f"{store.root}/step-00000002/{CKPT}"
    data = bytearray(store.fs.cat_file(key))
    data[3] ^= 0x01
    store.fs.pipe_file(key, bytes(data))
    rc, out, err = _run(capsys, "verify", uri, *flags)
    assert rc == 1 and "step 2: FAILED" in out and "checksum" in out and "step 1: OK" in out


def test_gc_on_s3_reads_each_manifest_once(
    s3_uri: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """``gc`` lists and reads the folder once (it used to list and read every manifest twice; issue 27)."""
    from tests.helpers.s3_requests import s3_requests

    uri, options = s3_uri
    store = CheckpointStore(uri, options, run_id="s3-run")
    for step in range(6):
        _commit(store, step)
    with s3_requests() as log:
        rc, out, err = _run(capsys, "gc", uri, "--keep-last", "2", *_s3_flags(options))
    assert rc == 0, err
    assert "committed steps kept: [4, 5]" in out
    manifest_gets = [t for m, t, _ in log.requests if m == "GET" and t.endswith("/manifest.json")]
    assert sorted(t.rsplit("/", 2)[-2] for t in manifest_gets) == [f"step-{s:08d}" for s in range(6)]
