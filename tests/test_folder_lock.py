"""One writer per output folder: a second run on a folder another run is writing refuses at once, naming the other
run; a lock left by a process that died is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import pytest
from conftest import run_cli

from dflash_gguf import folder_lock
from dflash_gguf.errors import FolderBusyError

_HOLD = ("import sys, time\nfrom pathlib import Path\nfrom dflash_gguf import folder_lock\n"
         "with folder_lock.writing(Path(sys.argv[1]), 'a test holding the lock'):\n"
         "    print('held', flush=True)\n    time.sleep(600)\n")


def _holder(folder: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_pipeline_on_a_busy_folder_refuses_and_a_dead_holder_frees_it(tmp_path: Path) -> None:
    target = mf.make_gemma4_target(tmp_path / "targets")
    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    out = tmp_path / "pair"
    holder = _holder(out)
    try:
        busy = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out)
        assert busy.returncode == 19, busy.stdout + busy.stderr
        assert f"pid {holder.pid}" in busy.stderr and "a test holding the lock" in busy.stderr
        assert not list(out.glob("*.gguf*")) and not (out / "pair.json").exists()  # nothing written
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # dies holding it: the kernel releases the lock
        holder.wait()
    done = run_cli("dflash-convert", "--target", target, "--drafter", drafter, "--outdir", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "pair.json").is_file()


def test_tune_does_not_record_into_a_folder_being_written(demo_pair: Path, tmp_path: Path) -> None:
    import shutil

    from dflash_gguf.pipeline.serve import record_tuning

    folder = Path(shutil.copytree(demo_pair, tmp_path / "pair"))
    before = (folder / "pair.json").read_bytes()
    with folder_lock.writing(folder, "the pipeline"), pytest.raises(FolderBusyError, match="the pipeline"):
        record_tuning(folder / "pair.json", None)  # type: ignore[arg-type]  # refused before the report is read
    assert (folder / "pair.json").read_bytes() == before
