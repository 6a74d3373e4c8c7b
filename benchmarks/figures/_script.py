"""Figures measured by a script of their own (benchmarks/cold_load.py,
benchmarks/scheduler_decision.py), run as a subprocess that writes its JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import RESULTS, ROOT, log, save_json


def run_script(figure: int, script: str, result: str, quick: bool, limit: float) -> dict:
    """Run benchmarks/SCRIPT (``--quick`` in quick mode, ``--out results/RESULT.json``)
    as a subprocess; collect what it printed and the JSON it wrote. Its temporary files
    go to a directory of their own (TMPDIR), removed here however it ended: a script
    killed at ``limit`` seconds leaves none behind."""
    out = RESULTS / f"{result}.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out)]
    argv += ["--quick"] if quick else []
    data = {"figure": figure, "script": f"benchmarks/{script}", "json": None, "stdout": ""}
    started = time.time()
    log(f"fig {figure}: {' '.join(argv[1:])}")
    scratch = tempfile.mkdtemp(prefix=f"rsrv-fig{figure}-")
    env = {**os.environ, "TMPDIR": scratch}
    try:
        proc = subprocess.run(
            argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit
        )
        data["stdout"] = proc.stdout
        data["status"] = (
            "ok"
            if proc.returncode == 0
            else f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
        )
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout or b""
        data["stdout"] = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
        data["status"] = f"timed out after {limit:.0f} s"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if out.is_file() and out.stat().st_mtime >= started:
        try:
            data["json"] = json.loads(out.read_text())
        except ValueError:
            pass
    data["method"] = (data["json"] or {}).get("method", "see the script's docstring")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "logs" / f"fig{figure}_{result}.txt").write_text(data["stdout"])
    print(data["stdout"].rstrip())
    save_json(f"fig{figure}_{result}", data)
    if data["status"] != "ok":
        log(f"fig {figure}: {data['status']}")
    return data


def printed(data: dict) -> list[str]:
    """What the script printed, as a code block (the fallback when it wrote no JSON)."""
    text = data.get("stdout", "").rstrip()
    return ["```", text, "```"] if text else [f"({data.get('status')})"]
