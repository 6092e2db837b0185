"""scripts/ray_scaling.py: its flags refused before any run, and a figure replaced only by a complete one."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ray_scaling_script", REPO / "scripts" / "ray_scaling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("flags", "message"), [
    (["--actors", "2", "0"], "--actors and --total_steps take numbers >= 1, got --actors 2 0 --total_steps 40000"),
    (["--total_steps", "-5"], "--actors and --total_steps take numbers >= 1, got --actors 1 2 4 --total_steps -5"),
    # then the figure formats of the matplotlib installed
    (["--out", "{tmp}/scaling.txt"], "--out {tmp}/scaling.txt: name a figure file (."),
    (["--out", "{tmp}/missing/scaling.png"], "--out {tmp}/missing/scaling.png: its directory does not exist"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str],
        message: str) -> None:
    script = _script()
    monkeypatch.setattr(script, "measure", lambda *args: pytest.fail("a run started"))
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    if "--out" not in flags:
        flags += ["--out", str(tmp_path / "scaling.png")]
    monkeypatch.setattr(sys, "argv", ["ray_scaling.py", "--kinds", "local", *flags])
    with pytest.raises(SystemExit) as exited:
        script.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"ray_scaling.py: error: {message.format(tmp=tmp_path)}")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_leaves_the_last_figure_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    out = tmp_path / "scaling.png"
    out.write_bytes(b"the last figure")
    points = iter([0, 2])  # the second run refused, as run.py refuses a bad flag

    def measure(kind: str, count: int, total_steps: int) -> dict:
        return {"kind": kind, "actors": count, "returncode": next(points), "steps_per_s": 100.0 * count}

    monkeypatch.setattr(script, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["ray_scaling.py", "--kinds", "local", "--actors", "1", "2", "--out", str(out)])
    assert script.main() == 1
    assert out.read_bytes() == b"the last figure" and not out.with_suffix(".json").exists()
    assert capsys.readouterr().err.strip() == f"ray_scaling: 1 of 2 runs failed (above); {out} left as it was"
    points = iter([0, 0])
    assert script.main() == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.with_suffix(".json").is_file()


def test_ray_points_without_ray_installed_are_refused_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script()
    monkeypatch.setattr(script, "measure", lambda *args: pytest.fail("a run started"))
    monkeypatch.setattr(script.importlib.util, "find_spec", lambda name: None)  # as where Ray is not installed
    monkeypatch.setattr(sys, "argv", ["ray_scaling.py", "--out", str(tmp_path / "scaling.png")])
    with pytest.raises(SystemExit) as exited:
        script.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "ray_scaling.py: error: --kinds ray needs Ray (pip install -r requirements-ray.txt); --kinds local measures "
        "without it")
