"""``bench`` (benchmarks/bench.py through the CLI's loader): a failing mode is a result, not the end of the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_async_ckpt.tools.plan_commands import load_bench

# Tiny sizes: one Linear(16, 16), 6 steps, a checkpoint every 2 steps; the run takes a few seconds on CPU.
_TINY = ["--param-mb", "0.002", "--width", "16", "--batch", "2", "--steps", "6", "--every", "2", "--device", "cpu"]


def _exploding_mode(ctx: Any) -> Any:
    """A peer mode whose callback raises mid-fit, the way DCP's stager raised ``KeyError`` on torch 2.11."""
    from lightning.pytorch.callbacks import Callback

    class _Explodes(Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == ctx.args.every:
                raise KeyError(type)

    return load_bench().ModeSetup(callbacks=[_Explodes()])


def test_a_failing_mode_is_recorded_and_later_modes_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench()
    monkeypatch.setitem(bench.MODE_SETUPS, "explodes", _exploding_mode)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = [*_TINY, "--modes", "explodes,ours_copy", "--dir", str(tmp_path / "scratch")]
    rc = bench.main([*argv, "--json", str(out_json), "--markdown", str(out_md)])
    assert rc == 0  # a peer mode failing is a result; only this library's own modes failing exit 1

    body = json.loads(out_json.read_text())
    by_mode = {r["mode"]: r for r in body["results"]}
    assert by_mode["explodes"]["error"].startswith("KeyError: ")
    assert "type" in by_mode["explodes"]["error"]
    ours = by_mode["ours_copy"]
    assert ours["error"] is None and ours["checkpoints"] >= 1 and ours["bytes"] > 0
    assert body["torch"] == torch.__version__

    table = out_md.read_text()
    assert f"torch {torch.__version__}" in table.splitlines()[4]
    failed_row = next(line for line in table.splitlines() if line.startswith("| explodes |"))
    assert "FAILED: KeyError: " in failed_row
    assert any(line.startswith("| ours_copy |") and "FAILED" not in line for line in table.splitlines())
    assert "explodes: FAILED: KeyError" in capsys.readouterr().out


def test_our_own_mode_failing_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench()

    def broken(ctx: Any) -> Any:
        raise RuntimeError("wiring broke")

    monkeypatch.setitem(bench.MODE_SETUPS, "ours_copy", broken)
    argv = [*_TINY, "--modes", "none,ours_copy", "--dir", str(tmp_path / "s"), "--json", str(tmp_path / "b.json")]
    assert bench.main(argv) == 1
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    # The baseline runs first and again last: the mode after the failure still ran.
    assert [(r["mode"], r["error"]) for r in results] == [
        ("none", None),
        ("ours_copy", "RuntimeError: wiring broke"),
        ("none", None),
    ]


def test_every_bench_flag_has_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_bench().main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag, words in {
        "--param-mb": "fp32 parameter MB",
        "--width": "width of each square Linear",
        "--batch": "batch size",
        "--steps": "training steps per mode",
        "--every": "checkpoint every N",
        "--modes": "comma-separated subset",
        "--dir": "scratch folder",
        "--device": "where the model trains",
        "--upload-nice": "nice value",
        "--max-outstanding": "saves in flight",
        "--json": "JSON file",
        "--markdown": "also write the table",
    }.items():
        assert flag in out and words in out, flag
    assert "recorded with its error" in out


def test_the_lightning_cpu_preset_interleaves_the_modes_and_prints_ratios_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The preset's model and schedule, scaled down by explicit flags (an explicit flag wins over the preset).
    argv = ["--preset", "lightning-cpu", "--repeats", "2", *_TINY, "--dir", str(tmp_path / "s")]
    assert load_bench().main(argv) == 0
    out = capsys.readouterr().out
    runs = [line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("# repeat ")]
    modes = ["none", "model_checkpoint", "async_checkpoint_io", "ours", "ours_huge_pages"]
    assert runs == modes * 2  # interleaved, in one process
    repeats = [line for line in out.splitlines() if line.startswith("# repeat ")]
    assert all("(os.sync " in line for line in repeats)  # every mode's wall time ends when it is durable
    # Every checkpointing mode writes the same checkpoints (ours: its final one is the last cut's, not an extra one).
    files = {line.split()[3].rstrip(":"): line.split(", ")[2] for line in repeats}
    assert files == {"none": "0 checkpoint files", **dict.fromkeys(runs[1:5], "3 checkpoint files")}, files
    header = next(line for line in out.splitlines() if line.startswith("| mode (2 repeats"))
    for column in ("hooks s/ckpt", "step slowdown s/ckpt", "wall overhead s", "reported slowdown s/ckpt"):
        assert column in header
    assert "ckpt CPU s/GB" in header and "library CPU s/GB" in header
    assert "CPU floor per GB, this run" in out and "crc32c" in out
    assert "Hooks floor, this run" in out and "final copy" in out  # the floor of the hooks, measured beside them
    ratios = out[out.index("Ratios of ours to async_checkpoint_io") :]
    assert "- hooks s/ckpt:" in ratios and "- step slowdown s/ckpt:" in ratios
    assert "(target <= 0.05x)" in ratios and "(target <= 0.10x)" in ratios and "(target <= 1.30x)" in ratios
    assert "- hooks s of ours to the hooks floor:" in ratios
    assert "- the hooks floor to async_checkpoint_io's hooks s:" in ratios
    assert "For docs/benchmarks.md" in ratios
    assert "Ratios of ours_huge_pages to async_checkpoint_io" in ratios  # the opt-in, measured beside the defaults
    assert not any(line.startswith("|") for line in ratios.splitlines())  # the ratios come last


def test_the_table_lists_the_baseline_once_and_each_mode_announces_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 39, point 11: `none` runs first and last (drift), but is one row; progress says what runs now.
    bench = load_bench()
    out_md = tmp_path / "bench.md"
    argv = [*_TINY, "--modes", "none,ours_copy", "--dir", str(tmp_path / "s"), "--json", str(tmp_path / "b.json")]
    assert bench.main([*argv, "--markdown", str(out_md)]) == 0
    rows = [line.split("|")[1].strip() for line in out_md.read_text().splitlines() if line.startswith("| ")]
    assert rows[1:] == ["none", "ours_copy"]  # after the header
    out = capsys.readouterr().out
    assert "# [1/3] none: running" in out and "# [2/3] ours_copy: running" in out and "# [3/3] none: running" in out
