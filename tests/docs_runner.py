"""Runs the docs' python blocks for tests/test_docs.py, sharing one interpreter's imports.

``python -m tests.docs_runner BLOCKS.json RESULTS.json``: BLOCKS is a list of ``{"id", "code"}``.
The runner imports what the blocks import that is expensive (torch, Lightning, this package) once,
then forks a child per block: the child starts in a fresh temporary folder, with the block saved
there as ``block.py`` (``sys.argv[0]``, ``sys.path[0]``: as ``python block.py`` would have them) and
runs it as ``__main__``; its stdout and stderr go to files. So every block runs as a standalone
script would, without paying the imports again. RESULTS maps each id to ``{"status", "output",
"stdout", "folder"}`` (status 0: success; output: the end of stdout and stderr, for a failure's
message; stdout whole, for a docs ``output`` block to be compared with; folder: the block's cwd).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

TIMEOUT_S = 600  # one block; the docs convention asks for < 30 s on one CPU core
HEAVY = (("torch", "torch"), ("lightning", "lightning.pytorch"), ("cephalo_lightning", "cephalo_lightning"))


def _preload(codes: list[str]) -> None:
    for word, module in HEAVY:
        if any(word in code for code in codes):
            __import__(module)


def _child(code: str, folder: Path) -> None:
    script = folder / "block.py"
    script.write_text(code)
    for stream, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        os.dup2(os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
    os.chdir(folder)
    sys.argv = [str(script)]
    sys.path[0] = str(folder)
    status = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_block(code: str) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="docs-block-"))
    pid = os.fork()
    if pid == 0:
        _child(code, folder)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.05)
    stdout, stderr = ((folder / name).read_text(errors="replace") if (folder / name).exists() else ""
                      for name in ("stdout.txt", "stderr.txt"))
    code_ = os.waitstatus_to_exitcode(status) if status != -1 else "timeout"
    return {"status": code_, "output": (stdout + stderr)[-6000:], "stdout": stdout, "folder": str(folder)}


def main(argv: list[str]) -> int:
    blocks = json.loads(Path(argv[0]).read_text())
    os.environ["WANDB_MODE"] = "offline"
    _preload([b["code"] for b in blocks])
    results = {b["id"]: run_block(b["code"]) for b in blocks}
    Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
