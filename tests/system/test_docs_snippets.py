"""Every ```python block of README.md and docs/*.md runs, so a snippet cannot rot.

The blocks of one page run in order in one fresh interpreter (like a notebook: a later block may use what an earlier
one defined), from an empty temporary folder, under a time budget per page, **as written on a laptop**: no ``AWS_*``
variable reaches them (not even a developer's own credentials), so a block that uses object storage starts its own
loopback S3 stand-in (moto) as the page shows, and nothing else is prepared for it.

Each page's interpreter is forked from a zygote that imported torch, Lightning, Accelerate, s3fs and this package
once (that import took 5-17 s of every page's 15-22 s on the 2-core machine; the zygote is itself forked from the
session's rank zygote, which did most of it); it has run nothing, and every page starts with an empty namespace, so
a snippet still has to import what it uses.

On the pages named in :data:`SHELL_PAGES` the ``lightning-async-ckpt`` lines of the ``bash`` blocks run too, after
the page's Python blocks, in the same folder (``python -m lightning_async_ckpt``, the same command line).

A block may opt out only with the first line ``# snippet: skip (needs ...)`` naming a resource this machine lacks
(GPUs, more processes, a real cloud account); :data:`JUSTIFIED` is the list of accepted reasons. Every fenced block
must name its language, so that Python cannot hide in an untagged block.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.dist import ZYGOTE_START_TIMEOUT_S
from tests.helpers.forked import Worker, start_script

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Seconds one page's blocks may take together.
PAGE_BUDGET_S = 240
SKIP_RE = re.compile(r"^#\s*snippet:\s*skip\s*\((?P<reason>[^)]*)\)\s*$")
#: Reasons a block may give for not running here.
JUSTIFIED = re.compile(r"needs (\d+ |a |an )?(GPUs?|CUDA|processes|nodes|real (cloud|AWS|GCS|Azure) account)", re.I)
#: Pages whose ``lightning-async-ckpt`` shell lines run too, after the page's Python blocks, in the same folder.
SHELL_PAGES = ("getting-started.md",)
#: Seconds one command line may take (a fresh interpreter).
COMMAND_BUDGET_S = 120
_FENCE_RE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^`\s]*)\s*$")


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block, dedented (blocks inside list items are indented)."""
    out: list[tuple[int, str, str]] = []
    lines = page.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE_RE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, lang, body = i + 1, m.group("lang"), []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        out.append((start, lang, textwrap.dedent("\n".join(body))))
        i += 1
    return out


def _python_pages() -> list[Path]:
    return [p for p in PAGES if any(lang == "python" for _, lang, _ in _blocks(p))]


_ZYGOTE = """
import gc, json, os, signal, sys, traceback

import torch, lightning.pytorch, lightning.pytorch.demos.boring_classes, s3fs, fsspec  # noqa
import torch.distributed.checkpoint  # noqa
import lightning_async_ckpt, lightning_async_ckpt.lightning, lightning_async_ckpt.testing  # noqa
try:
    import lightning_async_ckpt.accelerate  # noqa
except ImportError:
    pass


def run(args):
    namespace = {"__name__": "__main__"}
    for label, path in zip(args[0::2], args[1::2]):
        print(f"--- running {label}", flush=True)
        code = open(path).read()
        try:
            exec(compile(code, label, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"--- FAILED {label}", flush=True)
            sys.exit(1)


gc.freeze()
print("READY", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        signal.alarm(job["budget"])  # SIGALRM ends a page past its budget
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, name, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, job["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            os.dup2(os.open(name, flags, 0o644), fd)
        sys.argv = ["-c", *job["args"]]
        run(job["args"])
        sys.exit(0)  # through interpreter finalization, like the interpreter it stands for
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def _page_env() -> dict[str, str]:
    """A laptop's environment: no cloud configuration, no rank variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env["AWS_EC2_METADATA_DISABLED"] = "true"  # a block reaching for real S3 fails at once instead of probing
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull  # nor reads ~/.aws
    return env


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """One interpreter with the docs' imports done; it forks one child per page.

    It is itself forked from the session's zygote (``tests/helpers/forked.py``: torch, Lightning and s3fs imported
    there already), so only what that one lacks is imported here; leaving the block kills it (it holds no state).
    """
    script = tmp_path_factory.mktemp("docs-zygote") / "docs_zygote.py"
    script.write_text(_ZYGOTE)
    with start_script([sys.executable, str(script)], env=_page_env(), stdin=True) as proc:
        ready = proc.readline(timeout=ZYGOTE_START_TIMEOUT_S)
        assert ready.strip() == "READY", f"the snippet zygote died: {ready!r}\n{proc.stderr[-4000:]}"
        yield proc


def test_every_block_names_its_language() -> None:
    untagged = [f"{p.relative_to(ROOT)}:{line}" for p in PAGES for line, lang, _ in _blocks(p) if not lang]
    assert untagged == [], "tag these blocks (```python, ```bash, ```text, ...)"


def test_opt_outs_are_rare_and_justified() -> None:
    skips = []
    for page in PAGES:
        for line, lang, code in _blocks(page):
            first = code.strip().split("\n", 1)[0]
            m = SKIP_RE.match(first)
            if lang == "python" and m:
                assert JUSTIFIED.search(m.group("reason")), f"{page.name}:{line}: unjustified opt-out {first!r}"
                skips.append(f"{page.name}:{line}")
            elif lang == "python":
                assert "snippet:" not in first, f"{page.name}:{line}: malformed marker {first!r}"
    assert len(skips) <= 3, f"too many opted-out snippets: {skips}"  # a real bucket (2), a second node (1)


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_run(page: Path, zygote: Worker, tmp_path: Path) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    args = []
    for line, lang, code in _blocks(page):
        first = code.strip().split("\n", 1)[0]
        if lang != "python" or SKIP_RE.match(first):
            continue
        script = tmp_path / f"block-{line}.py"
        script.write_text(code)
        args += [f"{page.relative_to(ROOT)}:{line}", str(script)]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    job = {"cwd": str(work), "env": _page_env(), "args": args, "out": str(out), "err": str(err)}
    zygote.write(json.dumps({**job, "budget": PAGE_BUDGET_S}) + "\n")
    line = zygote.readline(timeout=PAGE_BUDGET_S + 120)  # the page's own alarm ends it past its budget
    assert line, f"the snippet zygote died\n{zygote.stderr[-4000:]}"
    rc = json.loads(line)["rc"]
    stdout, stderr = out.read_text(), err.read_text()
    if rc == -14:  # SIGALRM
        pytest.fail(f"{page.name}: snippets ran past {PAGE_BUDGET_S}s\n{stdout}\n{stderr}")
    assert rc == 0, f"{page.name}: a snippet failed\n{stdout[-4000:]}\n{stderr[-8000:]}"
    if page.name in SHELL_PAGES:
        for command in _cli_lines(page):
            argv = [sys.executable, "-m", "lightning_async_ckpt", *shlex.split(command, comments=True)[1:]]
            done = subprocess.run(
                argv, cwd=work, env=_page_env(), capture_output=True, text=True, timeout=COMMAND_BUDGET_S
            )
            assert done.returncode == 0, (
                f"{page.name}: `{command}` exited {done.returncode}\n{done.stdout}\n{done.stderr}"
            )


def _cli_lines(page: Path) -> list[str]:
    """The ``lightning-async-ckpt ...`` lines of a page's bash blocks."""
    return [
        line.strip()
        for _, lang, code in _blocks(page)
        if lang == "bash"
        for line in code.split("\n")
        if line.strip().startswith("lightning-async-ckpt ")
    ]


def test_the_readme_sends_a_newcomer_to_getting_started_first() -> None:
    text = (ROOT / "README.md").read_text()
    listing = text[text.index("## Documentation") :]
    first = re.search(r"\[[^\]]*\]\((?P<target>[^)]+)\)", listing)
    assert first is not None and first.group("target") == "docs/getting-started.md", listing[:300]
    assert (ROOT / "docs" / "getting-started.md").is_file()


#: What development history looks like in a page: the tracker's numbers, work sessions, commit references.
HISTORY_RE = re.compile(
    r"\bissue \d+|\bsessions?\b|\bcommit [0-9a-f]{7,40}\b|\b[0-9a-f]{7}\^|\bbefore this (round|change)\b", re.I
)


def test_user_docs_hold_no_development_history() -> None:
    found = [
        f"{page.relative_to(ROOT)}:{number}: {m.group(0)!r}"
        for page in PAGES
        for number, line in enumerate(page.read_text().split("\n"), 1)
        for m in HISTORY_RE.finditer(line)
    ]
    assert found == [], "the story of how a result was reached belongs in commit messages"
