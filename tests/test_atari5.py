"""Atari-5 arithmetic against numbers worked by hand and from the authors' data, and the `atari5` experiment
of scripts/results.py on run directories written the way run.py writes them (no training)."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from process_helpers import sigterm_to_it_alone, wait_until_gone
from torch.utils.tensorboard import SummaryWriter

from impala import atari5
from impala.stopping import Terminated

REPO = Path(__file__).resolve().parent.parent
BZ, DD, NTG, PHX, QB = (g.env_id for g in atari5.GAMES)


def _results_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_script", REPO / "scripts" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["results_script"] = module
    spec.loader.exec_module(module)
    return module


results = _results_script()


def _authors_subset_score(normalised: dict[str, float]) -> float:
    """The prediction written out as the first author's `subset_score` does it (tools/plot_util.py of
    maitchison/PPO): a running total of weight * log10(1 + clip(x, 0)) over the games, then 10 ** total - 1."""
    weights = {"battlezone": 0.3819751237831753, "doubledunk": 0.0679099488887574,
               "namethisgame": 0.310804148620847, "phoenix": 0.12412619402774641, "qbert": 0.08048518286466755}
    total = 0.0
    for name, weight in weights.items():
        total += math.log10(1 + max(normalised[name], 0.0)) * weight
    return 10 ** total - 1


def test_normalisation_by_hand() -> None:
    # Battle Zone: random 2360, human 37187.5, so a score of 19773.75 is half way: 50%.
    assert atari5.normalised(BZ, 19773.75) == pytest.approx(50.0)
    assert atari5.normalised(BZ, 2360.0) == 0.0 and atari5.normalised(BZ, 37187.5) == pytest.approx(100.0)
    # Double Dunk: random -18.55, human -16.4 (a gap of 2.15): a score of 0 is 18.55 / 2.15 = 862.79%.
    assert atari5.normalised(DD, 0.0) == pytest.approx(100 * 18.55 / 2.15)
    assert atari5.normalised(DD, -20.0) == pytest.approx(-100 * 1.45 / 2.15)  # worse than random: negative
    # Q*bert: random 163.88, human 13455.
    assert atari5.normalised(QB, 13455.0 + 13291.12) == pytest.approx(200.0)
    with pytest.raises(KeyError, match="not an Atari-5 game"):
        atari5.normalised("PongNoFrameskip-v4", 21.0)


def test_normalisation_matches_the_authors_dataset() -> None:
    """IMPALA (deep)'s raw scores and the Normalized column of dataset.csv in maitchison/Atari-5 (118cad5),
    which the authors' atari5.py wrote from the same Random and Human columns."""
    impala_deep = {BZ: (20885.0, 53.190725719618115), DD: (-0.33, 847.4418604651155),
                   NTG: (21537.2, 334.3064108465862), PHX: (210996.45, 3243.7673578966856),
                   QB: (351200.12, 2641.1336290696345)}
    for env_id, (score, normalised) in impala_deep.items():
        assert atari5.normalised(env_id, score) == pytest.approx(normalised, rel=1e-12)


def test_weights_are_the_papers_and_a_game_at_zero_counts_as_zero() -> None:
    assert [g.weight for g in atari5.GAMES] == [0.3819751237831753, 0.0679099488887574, 0.310804148620847,
                                                  0.12412619402774641, 0.08048518286466755]
    assert sum(g.weight for g in atari5.GAMES) == pytest.approx(0.9654, abs=1e-4)  # no intercept: not 1
    assert atari5.predicted_median({g.env_id: 0.0 for g in atari5.GAMES}) == 0.0
    assert atari5.predicted_median({g.env_id: -50.0 for g in atari5.GAMES}) == 0.0  # clipped at 0 as in the fit
    # Every game at 99%: 10 ** (0.9654 * log10(100)) - 1 = 100 ** 0.9654 - 1.
    same = atari5.predicted_median({g.env_id: 99.0 for g in atari5.GAMES})
    assert same == pytest.approx(100 ** sum(g.weight for g in atari5.GAMES) - 1)
    with pytest.raises(KeyError, match="missing QbertNoFrameskip-v4"):
        atari5.predicted_median({BZ: 1.0, DD: 1.0, NTG: 1.0, PHX: 1.0})


@pytest.mark.parametrize(("name", "scores", "true_median", "predicted"), [
    # Rainbow (no-op starts), RAINBOW (fixed).csv in maitchison/Atari-5: its median over the 56 games there.
    ("Rainbow", {BZ: 62010.0, DD: -0.3, NTG: 13136.0, PHX: 108528.6, QB: 33817.5}, 227.05, 225.10),
    # IMPALA (deep), from paperswithcode in the same dataset: its 57-game median there is 191.82, the
    # prediction 18% above it.
    ("IMPALA (deep)", {BZ: 20885.0, DD: -0.33, NTG: 21537.2, PHX: 210996.45, QB: 351200.12}, 191.82, 226.70),
    ("DQN (no-op starts)", {BZ: 29900.0, DD: -6.6, NTG: 8207.8, PHX: 8485.2, QB: 13117.3}, 77.57, 89.93),
])
def test_regression_on_published_algorithms(name: str, scores: dict[str, float], true_median: float,
                                            predicted: float) -> None:
    """Published five-game scores from the authors' dataset: the prediction equals the authors' formula,
    and it lands near the median of all games that the same dataset gives for that algorithm."""
    normalised = {env_id: atari5.normalised(env_id, score) for env_id, score in scores.items()}
    ours = atari5.predicted_median(normalised)
    by_name = dict(zip(("battlezone", "doubledunk", "namethisgame", "phoenix", "qbert"), normalised.values()))
    assert ours == pytest.approx(_authors_subset_score(by_name), rel=1e-12)
    assert ours == pytest.approx(predicted, abs=0.01)
    assert abs(math.log(ours / true_median)) < 0.2, name  # within ~20%: the paper's typical error is ~10%


def test_cleanrl_reference_and_its_predicted_median() -> None:
    g = atari5.game(BZ)
    assert (g.cleanrl_ppo, g.cleanrl_ppo_std) == (24283.75, 1841.94)
    expected = {BZ: 100 * (24283.75 - 2360) / 34827.5, DD: 100 * (-6.81 + 18.55) / 2.15,
                NTG: 100 * (5750 - 2292.35) / 5756.65, PHX: 100 * (14474.11 - 761.4) / 6481.2,
                QB: 100 * (17246.27 - 163.88) / 13291.12}
    assert atari5.cleanrl_predicted_median() == pytest.approx(atari5.predicted_median(expected))
    assert atari5.cleanrl_predicted_median() == pytest.approx(76.566, abs=1e-3)  # docs/atari5.md quotes it


# ------------------------------------------------------------------------------- the atari5 experiment


def _finished_run(savedir: Path, xpid: str, env_id: str, returns: list[float], total_steps: int = 10_000_000,
                  end_reason: str = "finished", checkpoint: bool = True) -> Path:
    """A run directory as run.py leaves it: flags.json, meta.json, logs.csv (no event files), model.tar."""
    run_dir = savedir / xpid
    run_dir.mkdir(parents=True)
    (run_dir / "flags.json").write_text(json.dumps({"env": env_id, "total_steps": total_steps, "num_actors": 4,
                                                    "envs_per_actor": 8, "policy_loss": "ppo"}))
    final_step = total_steps if end_reason == "finished" else total_steps // 2
    (run_dir / "meta.json").write_text(json.dumps({"starts": ["2026-01-01T00:00:00+00:00"], "end_reason": end_reason,
                                                   "final_step": final_step}))
    with open(run_dir / "logs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "charts/SPS", "charts/mean_return_100"])
        writer.writerows([[1000 * (i + 1), 5000, value] for i, value in enumerate(returns)])
    if checkpoint:
        (run_dir / "model.tar").write_bytes(b"")
    return run_dir


def test_a_finished_game_is_skipped_and_an_unfinished_one_resumed(tmp_path: Path) -> None:
    done = _finished_run(tmp_path, "done", BZ, [1.0])
    stopped = _finished_run(tmp_path, "stopped", BZ, [1.0], end_reason="interrupted")
    short = _finished_run(tmp_path, "short", BZ, [1.0], total_steps=3000)  # finished at its own total_steps
    crashed = _finished_run(tmp_path, "crashed", BZ, [1.0], end_reason="error", checkpoint=False)
    assert [results.run_state(d) for d in (done, stopped, short, crashed)] == ["finished", "resume", "finished", "new"]
    assert results.run_state(tmp_path / "never") == "new"
    last = _finished_run(tmp_path, "last", BZ, [1.0], total_steps=5000, end_reason="interrupted")
    (last / "meta.json").write_text(json.dumps({"end_reason": "interrupted", "final_step": 5120}))
    assert results.run_state(last) == "finished"  # the stop came with its last update: run.py trains it no further
    assert results.atari5_xpid("atari5", BZ, 0, 1) == "atari5-BattleZone"
    assert results.atari5_xpid("a5", QB, 2, 3) == "a5-Qbert-s2"


def test_table_from_finished_run_directories(tmp_path: Path) -> None:
    """Five finished games (their last mean_return_100 in logs.csv, a session and a greedy test in
    atari5.json): the table shows each game's scores, normalised scores, CleanRL's, and the medians."""
    mean_returns = {BZ: 19773.75, DD: 0.0, NTG: 2292.35, PHX: 7242.6, QB: 163.88 + 2 * 13291.12}
    rows = []
    for g in atari5.GAMES:
        xpid = results.atari5_xpid("atari5", g.env_id, 0, 1)
        run_dir = _finished_run(tmp_path, xpid, g.env_id, [0.0, mean_returns[g.env_id]])
        (run_dir / results.ATARI5_RECORD).write_text(json.dumps({
            "sessions": [{"wall_s": 3600.0, "machine": "CPU X, 16 cores, GPU Y"},
                         {"wall_s": 1800.0, "machine": "CPU X, 16 cores, GPU Y"}],
            "greedy_test_mean": g.random, "greedy_test_episodes": 10}))
        rows.append(results.atari5_row(run_dir, g.env_id, 0))
    battle_zone = rows[0]
    assert battle_zone["mean_last_100"] == 19773.75 and battle_zone["hns_last_100"] == pytest.approx(50.0)
    assert battle_zone["hns_greedy"] == 0.0 and battle_zone["wall_s"] == 5400.0 and battle_zone["sessions"] == 2
    assert battle_zone["machine"] == "CPU X, 16 cores, GPU Y" and battle_zone["state"] == "finished"
    medians = results.atari5_medians(rows)
    normalised = {BZ: 50.0, DD: 100 * 18.55 / 2.15, NTG: 0.0, PHX: 100.0, QB: 200.0}
    assert medians["last_100"] == pytest.approx(atari5.predicted_median(normalised))
    assert medians["greedy"] == 0.0  # every greedy test scored exactly random
    stopped_early = [{**row, "state": "resume"} if row is battle_zone else row for row in rows]
    assert results.atari5_medians(stopped_early)["last_100"] is None  # its score is where it stopped
    table = results.format_atari5(rows, json.loads((tmp_path / "atari5-BattleZone" / "flags.json").read_text()))
    assert "| Battle Zone | 10,000,000 | 19,773.8 | 2,360.0 (10) | 50.0 / 0.0 | 24,283.75 +- 1,841.94 | 62.9 |" in table
    assert "1.50 h | CPU X, 16 cores, GPU Y |" in table
    assert f"ours {medians['last_100']:,.1f}% (training" in table
    assert f"CleanRL PPO {atari5.cleanrl_predicted_median():,.1f}%" in table
    assert "| environments | 4 actors x 8 envs" in table and atari5.WEIGHTS_SOURCE in table


def test_plot_only_prints_and_writes_the_table_for_the_games_that_exist(tmp_path: Path, capsys) -> None:
    _finished_run(tmp_path, "atari5-Phoenix", PHX, [7242.6])
    argv = sys.argv
    sys.argv = ["results.py", "atari5", "--plot-only", "--savedir", str(tmp_path)]
    try:
        assert results.main() == 0
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "| Phoenix | 10,000,000 | 7,242.6 | - | 100.0 / - |" in out
    assert "| Battle Zone | - | - | - | - / - |" in out  # no run yet
    assert "ours -% (training" in out  # no prediction until all five games have a score
    written = json.loads((tmp_path / "atari5.json").read_text())
    assert [r["state"] for r in written["rows"]] == ["new", "new", "new", "finished", "new"]
    assert (tmp_path / "atari5.md").read_text() in out
    assert (tmp_path / "atari5.png").read_bytes().startswith(b"\x89PNG")  # the five panels, beside the table


def test_a_damaged_row_of_logs_csv_is_left_out_of_a_games_means_saying_so(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "atari5-Qbert"
    run_dir.mkdir()
    (run_dir / "logs.csv").write_bytes(b"step,charts/mean_return_100\n100,\n200,5.5\n30\xff0,7.\x00\n400,nan\n500,9.0\n")
    steps, means = results.csv_means(run_dir)
    assert steps.tolist() == [200, 500] and means.tolist() == [5.5, 9.0]
    assert capsys.readouterr().out.startswith("Run atari5-Qbert: left out 1 damaged row(s) of its logs.csv (line(s) 4)")


def test_the_figure_has_a_panel_per_game_with_cleanrls_score(tmp_path: Path) -> None:
    run_dir = tmp_path / "atari5-Qbert"
    run_dir.mkdir()
    with SummaryWriter(str(run_dir)) as writer:  # three games, as run.py logs them
        for step, value in ((1000, 100.0), (2000, 300.0), (3000, 500.0)):
            writer.add_scalar(results.RETURN_TAG, value, step)
    fig = results.atari5_figure([(QB, run_dir), (BZ, tmp_path / "atari5-BattleZone")])  # Battle Zone: not run yet
    assert [axes.get_title() for axes in fig.axes] == [g.name for g in atari5.GAMES]
    qbert, battle_zone = fig.axes[4], fig.axes[0]
    faint, mean = qbert.lines[0], qbert.lines[1]
    assert list(faint.get_xdata()) == [1000, 2000, 3000] and list(mean.get_ydata()) == [100.0, 200.0, 300.0]
    assert [line.get_ydata()[0] for line in qbert.lines[2:]] == [17246.27, 163.88]  # CleanRL's, random
    assert [line.get_ydata()[0] for line in battle_zone.lines] == [24283.75, 2360.0]  # no curve of ours


def test_games_picks_which_games_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    trained = []
    monkeypatch.setattr(results, "run_atari5_game", lambda args, flags, env_id, seed, xpid, kept: trained.append(xpid))
    argv = sys.argv
    try:
        sys.argv = ["results.py", "atari5", "--games", "qbert", "PhoenixNoFrameskip-v4", "--savedir", str(tmp_path)]
        assert results.main() == 0
        assert trained == ["atari5-Phoenix", "atari5-Qbert"]  # in the table's order
        assert "| Battle Zone | - |" in capsys.readouterr().out  # the table still has all five
        sys.argv = ["results.py", "atari5", "--games", "Pong", "--savedir", str(tmp_path)]
        with pytest.raises(SystemExit) as exit_info:
            results.main()
        assert exit_info.value.code == 2 and "got Pong" in capsys.readouterr().err
    finally:
        sys.argv = argv


def test_a_relative_savedir_is_the_callers_not_the_repositorys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys) -> None:
    """run.py runs in the repository: a --savedir relative to where the script was started is made absolute before
    it is passed on, so the runs and the table that reads them are in one place."""
    savedirs = []
    monkeypatch.setattr(results, "run_atari5_game", lambda args, *rest: savedirs.append(args.savedir))
    monkeypatch.chdir(tmp_path)
    assert _main("atari5", "--games", "Qbert", "--savedir", "runs") == 0
    assert savedirs == [tmp_path / "runs"] and (tmp_path / "runs" / "atari5.md").is_file()


def test_a_keep_that_is_a_file_is_refused_before_any_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys) -> None:
    monkeypatch.setattr(results, "run_atari5_game", lambda *args: pytest.fail("a game trained"))
    (tmp_path / "kept").write_text("notes")
    with pytest.raises(SystemExit) as exit_info:
        _main("atari5", "--savedir", str(tmp_path / "runs"), "--keep", str(tmp_path / "kept"))
    assert exit_info.value.code == 2
    assert f"--keep {tmp_path / 'kept'} is a file; name a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_run_pys_bad_input_records_no_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistyped run.py flag passed through (exit 2: nothing changed) leaves the game's atari5.json as it was."""
    run_dir = _finished_run(tmp_path, "atari5-Qbert", QB, [1.0], end_reason="interrupted")
    monkeypatch.setattr(results, "train", lambda *args: 2)
    monkeypatch.setattr(results, "machine_description", lambda: "a machine")
    args = argparse.Namespace(savedir=tmp_path, keep=None, minutes=None, test_episodes=1)
    with pytest.raises(SystemExit) as exit_info:
        results.run_atari5_game(args, ["--bogus_flag", "1"], QB, 0, "atari5-Qbert")
    assert exit_info.value.code == 2 and not (run_dir / results.ATARI5_RECORD).exists()


@pytest.mark.parametrize("flags", [["--seeds", "0"], ["--test_episodes", "0"], ["--minutes", "0"], ["--minutes", "nan"]])
def test_counts_below_one_are_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, flags: list[str]) -> None:
    monkeypatch.setattr(results, "ROOT", tmp_path)  # where the figure would go
    argv = sys.argv
    try:
        sys.argv = ["results.py", "cartpole", "--savedir", str(tmp_path / "runs"), *flags]
        with pytest.raises(SystemExit) as exit_info:
            results.main()
    finally:
        sys.argv = argv
    assert exit_info.value.code == 2 and f"{flags[0]} must be" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ kept records (--keep): runs of other machines


def _main(*argv: str) -> int:
    saved = sys.argv
    sys.argv = ["results.py", *argv]
    try:
        return results.main()
    finally:
        sys.argv = saved


def test_a_kept_curve_is_the_mean_of_the_last_100_games_at_most_200_times(tmp_path: Path) -> None:
    few = tmp_path / "few"
    with SummaryWriter(str(few)) as writer:
        for step, value in ((1000, 100.0), (2000, 300.0), (3000, 500.0)):
            writer.add_scalar(results.RETURN_TAG, value, step)
    assert results.curve_points(few) == [[1000, 100.0], [2000, 200.0], [3000, 300.0]]
    many = tmp_path / "many"
    with SummaryWriter(str(many)) as writer:
        for game in range(1000):  # returns 0..999 at steps 10, 20, ..., 10,000
            writer.add_scalar(results.RETURN_TAG, float(game), 10 * (game + 1))
    points = results.curve_points(many)
    assert 100 <= len(points) <= results.KEPT_CURVE_POINTS and points[0] == [10, 0.0] and points[-1] == [10_000, 949.5]
    for step, mean in points:  # after game g (step 10 (g + 1)): the mean of games max(0, g - 99)..g
        game = step // 10 - 1
        assert mean == pytest.approx((max(0, game - 99) + game) / 2)
    logs_only = _finished_run(tmp_path, "logs-only", QB, [5.0, 7.0])  # no event files: logs.csv's column
    assert results.curve_points(logs_only) == [[1000, 5.0], [2000, 7.0]]


def test_a_kept_game_is_tabled_drawn_and_not_trained_again_on_another_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    here, elsewhere, kept = tmp_path / "here", tmp_path / "elsewhere", tmp_path / "kept"
    run_dir = _finished_run(here, "atari5-Phoenix", PHX, [1000.0, 7242.6])
    (run_dir / results.ATARI5_RECORD).write_text(json.dumps({
        "sessions": [{"wall_s": 3600.0, "machine": "CPU X, 16 cores, GPU Y"}],
        "greedy_test_mean": 761.4, "greedy_test_episodes": 10}))
    assert _main("atari5", "--plot-only", "--savedir", str(here), "--keep", str(kept)) == 0
    record = json.loads((kept / "atari5-Phoenix.json").read_text())
    assert record["final_step"] == 10_000_000 and record["mean_last_100"] == 7242.6 and record["state"] == "finished"
    assert record["curve"] == [[1000, 1000.0], [2000, 7242.6]] and record["flags"]["env"] == PHX
    assert record["source"] == f"{run_dir} on CPU X, 16 cores, GPU Y"
    assert sorted(p.name for p in kept.iterdir()) == ["atari5-Phoenix.json"]  # only games that ran
    capsys.readouterr()

    monkeypatch.setattr(results, "train", lambda *args, **kwargs: pytest.fail("a kept finished game trained again"))
    assert _main("atari5", "--games", "Phoenix", "--savedir", str(elsewhere), "--keep", str(kept)) == 0
    out = capsys.readouterr().out
    assert "atari5-Phoenix: finished on CPU X, 16 cores, GPU Y" in out
    assert "| Phoenix | 10,000,000 | 7,242.6 | 761.4 (10) | 100.0 / 0.0 |" in out and "1.00 h | CPU X, 16 cores, GPU Y |" in out
    assert "| environments | 4 actors x 8 envs" in out  # the settings from the kept flags
    assert not (elsewhere / "atari5-Phoenix").exists()
    fig = results.atari5_figure([(PHX, elsewhere / "atari5-Phoenix")], {"atari5-Phoenix": record})
    phoenix = fig.axes[3]
    assert list(phoenix.lines[0].get_xdata()) == [1000, 2000] and list(phoenix.lines[0].get_ydata()) == [1000.0, 7242.6]
    assert phoenix.lines[0].get_label() == "atari5-Phoenix (kept)"


def test_a_finished_game_is_tested_greedily_once_and_its_games_lengths_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A game that finished without a greedy test gets one: test mode's mean return and its line on the games'
    lengths go into atari5.json and the kept record; the next call finds them and does not test again."""
    run_dir = _finished_run(tmp_path, "atari5-Phoenix", PHX, [1000.0, 7242.6])
    (run_dir / results.ATARI5_RECORD).write_text(json.dumps({"sessions": [{"wall_s": 60.0, "machine": "M"}]}))
    lengths = "Games lasted 1800-4400 agent steps (mean 3100); 0 of 10 cut by the time limit"
    commands: list[list[str]] = []

    def test_mode(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, "Mean return over 10 episodes: 5123.50 (min 2000.00, max "
                                           f"9000.00; checkpoint at step 10000000)\n{lengths}\n", "")

    monkeypatch.setattr(results.subprocess, "run", test_mode)
    monkeypatch.setattr(results, "train", lambda *args, **kwargs: pytest.fail("a finished game trained again"))
    kept = tmp_path / "kept"
    for _ in range(2):
        assert _main("atari5", "--games", "Phoenix", "--savedir", str(tmp_path), "--keep", str(kept)) == 0
    assert len(commands) == 1 and commands[0][1:] == ["run.py", "--mode", "test", "--savedir", str(tmp_path),
                                                      "--xpid", "atari5-Phoenix", "--test_episodes", "10"]
    record = json.loads((kept / "atari5-Phoenix.json").read_text())
    assert (record["greedy_test_mean"], record["greedy_test_episodes"]) == (5123.5, 10)
    assert record["greedy_test_lengths"] == lengths

    def train_on(*args: object, **kwargs: object) -> int:  # --total_steps 12e6: the game trains on to it
        meta = json.loads((run_dir / "meta.json").read_text())
        (run_dir / "meta.json").write_text(json.dumps({**meta, "final_step": 12_000_000}))
        (run_dir / "flags.json").write_text(json.dumps({"env": PHX, "total_steps": 12_000_000}))
        return 0

    monkeypatch.setattr(results, "train", train_on)
    monkeypatch.setattr(results, "machine_description", lambda: "M")
    assert _main("atari5", "--games", "Phoenix", "--savedir", str(tmp_path), "--total_steps", "12e6") == 0
    assert len(commands) == 2  # the agent of the new step tested, once
    monkeypatch.setattr(results, "train", lambda *args, **kwargs: pytest.fail("a finished game trained again"))
    assert _main("atari5", "--games", "Phoenix", "--savedir", str(tmp_path), "--total_steps=12000000") == 0
    assert len(commands) == 2 and json.loads((run_dir / results.ATARI5_RECORD).read_text())["greedy_test_step"] == \
        12_000_000


def test_the_total_steps_given_to_run_py_are_read_as_run_py_reads_them() -> None:
    assert results.total_steps_given(["--env", PHX, *results.ATARI5_FLAGS]) == results.ATARI5_STEPS
    assert results.total_steps_given([*results.ATARI5_FLAGS, "--seed", "1", "--total_steps", "2e7"]) == 20_000_000
    assert results.total_steps_given([*results.ATARI5_FLAGS, "--total_steps=15000000"]) == 15_000_000
    assert results.total_steps_given(["--total_steps", "1.5"]) is None and results.total_steps_given([]) is None


def test_a_kept_record_is_not_replaced_by_a_run_with_fewer_steps(tmp_path: Path, capsys) -> None:
    kept = tmp_path / "kept"
    finished = _finished_run(tmp_path / "a", "atari5-Qbert", QB, [13_000.0])
    results.keep(kept, results.kept_record(finished, QB, 0))
    restarted = _finished_run(tmp_path / "b", "atari5-Qbert", QB, [400.0], end_reason="interrupted")
    results.keep(kept, results.kept_record(restarted, QB, 0))  # 5M of 10M: the finished record stays
    assert json.loads((kept / "atari5-Qbert.json").read_text())["mean_last_100"] == 13_000.0
    assert "kept as it is (10,000,000 agent steps, this run 5,000,000)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        _main("pong", "--plot-only", "--keep", str(kept))
    assert exit_info.value.code == 2 and "--keep is for atari5 only" in capsys.readouterr().err


def test_a_greedy_test_that_fails_ends_the_script_with_run_pys_line(tmp_path: Path) -> None:
    """Test mode refused (here: no run, so no checkpoint): the script ends with run.py's one line, no traceback."""
    with pytest.raises(SystemExit) as stopped:
        results.greedy_test(tmp_path, "never-trained", 1)
    assert str(stopped.value).startswith("results: the greedy test of never-trained failed: run.py: error: ")


def test_sigterm_to_the_script_alone_stops_its_run_in_order_and_keeps_the_atari5_session(tmp_path: Path) -> None:
    """`kill PID` on scripts/results.py (or a device call's `timeout`) while an Atari-5 game trains: the run is
    stopped in order with it (checkpoint, meta.json), not left training on its own; the session is recorded in the
    run's atari5.json and, with --keep, the game's record is kept as it stands; one line, exit code 143."""
    kept = tmp_path / "kept"
    script = subprocess.Popen([sys.executable, "scripts/results.py", "atari5", "--games", "Phoenix", "--savedir",
                               str(tmp_path), "--keep", str(kept), "--num_actors", "1", "--envs_per_actor", "2",
                               "--unroll_length", "5", "--batch_size", "2", "--disable_cuda", "--log_interval_s", "1"],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    logs = tmp_path / "atari5-Phoenix" / "logs.csv"  # a row: it has learned
    err, _ = sigterm_to_it_alone(script, lambda: logs.is_file() and len(logs.read_text().splitlines()) >= 2)
    assert script.returncode == 143, err
    assert err.strip().splitlines()[-1] == "results: stopped by SIGTERM; the same command resumes the run", err
    assert "Traceback" not in err
    assert wait_until_gone(script.pid) == []
    assert (tmp_path / "atari5-Phoenix" / "model.tar").is_file()
    session, = json.loads((tmp_path / "atari5-Phoenix" / results.ATARI5_RECORD).read_text())["sessions"]
    meta = json.loads((tmp_path / "atari5-Phoenix" / "meta.json").read_text())
    assert meta["end_reason"] == "terminated" and session["final_step"] == meta["final_step"] > 0
    record = json.loads((kept / "atari5-Phoenix.json").read_text())
    assert (record["env"], record["final_step"]) == (PHX, meta["final_step"])


# ------------------------------------------------------------------ files that cannot be written: one line, exit code 2


def _tree(root: Path) -> dict[str, tuple[int, bytes] | None]:
    """Every path under `root`: a file's modification time and bytes, None for a directory."""
    return {str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("blocked", ["runs/atari5.md", "kept/atari5-Phoenix.json"])  # under tmp_path
def test_a_table_or_kept_record_that_cannot_be_written_is_one_line_and_nothing_else_changes(
        tmp_path: Path, capsys, blocked: str) -> None:
    """A directory where the table or a kept record goes (no permission, a full disk alike): `results.py: error:`
    naming the path and why, exit code 2, no traceback; the previous table, figure and runs are left as they were."""
    savedir = tmp_path / "runs"
    _finished_run(savedir, "atari5-Phoenix", PHX, [7242.6])
    (savedir / "atari5.json").write_text("the previous table\n")
    (savedir / "atari5.png").write_bytes(b"the previous figure")
    (tmp_path / blocked).mkdir(parents=True)
    keeping = blocked.startswith("kept/")
    what = "the kept record" if keeping else "the Atari-5 table"
    before = _tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        _main("atari5", "--plot-only", "--savedir", str(savedir), *(["--keep", str(tmp_path / "kept")] * keeping))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"results.py: error: cannot write {what} {tmp_path / blocked}: Is a directory\n"
    assert _tree(tmp_path) == before  # no temporary file left either


class _Run:
    """run.py as `train` starts it (subprocess.Popen), ending with `returncode`; `stop` is raised by its first
    wait, as the terminal's Ctrl-C (KeyboardInterrupt) or SIGTERM to the script (Terminated) is."""

    stop: type[BaseException] | None = None
    returncode = 0

    def __init__(self, command: list[str], **kwargs: object) -> None:
        self.waits = 0

    def wait(self, timeout: float | None = None) -> int:
        self.waits += 1
        if self.stop is not None and self.waits == 1:
            raise self.stop()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signalled = signum


@pytest.mark.parametrize(("stop", "signum"), [(KeyboardInterrupt, signal.SIGINT), (Terminated, signal.SIGTERM)])
def test_a_stop_that_came_to_the_script_alone_is_passed_on_to_its_run(
        monkeypatch: pytest.MonkeyPatch, stop: type[BaseException], signum: int) -> None:
    """`kill -INT PID` of a background results.py (or SIGTERM): the run gets the same signal and stops in order
    before the script ends, rather than training on unseen (a terminal's Ctrl-C, which reached the run too, is
    the run's second signal then, which it ignores)."""
    runs: list[_Run] = []
    monkeypatch.setattr(_Run, "stop", stop)
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: runs.append(_Run(*args, **kwargs)) or runs[-1])
    with pytest.raises(stop):
        results.train("atari5", 0, Path("runs"), "x", None, [], ["--env", PHX])
    assert runs[0].signalled == signum and runs[0].waits == 2  # waited for it once signalled


@pytest.mark.parametrize(("stop", "returncode", "code", "last_line"), [
    (KeyboardInterrupt, 130, 130, "results: stopped by Ctrl-C; the same command resumes the run"),
    (Terminated, 143, 143, "results: stopped by SIGTERM; the same command resumes the run"),
    (None, 0, 2, None),  # the run ended by itself: the failed write is the script's error
], ids=["ctrl-c", "sigterm", "ended"])
def test_a_session_record_that_cannot_be_written_does_not_replace_a_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, stop: type[BaseException] | None, returncode: int,
        code: int, last_line: str | None) -> None:
    """The run's atari5.json cannot be written (a directory here; a full disk alike) when a session ends: on
    Ctrl-C or SIGTERM one line says so, the game is still kept (--keep), and the script ends as the stop does, its
    line and exit code 130 or 143, no traceback; a session that ended by itself is one line and exit code 2."""
    run_dir = _finished_run(tmp_path, "atari5-Phoenix", PHX, [1000.0], end_reason="interrupted")
    (run_dir / results.ATARI5_RECORD).mkdir()
    kept = tmp_path / "kept"
    monkeypatch.setattr(_Run, "stop", stop)
    monkeypatch.setattr(_Run, "returncode", returncode)
    monkeypatch.setattr(subprocess, "Popen", _Run)  # the script runs afresh below: its `train` starts a _Run
    monkeypatch.setattr("impala.bench.machine", lambda: {"cpu": "CPU X", "cores_usable": 2, "device": "cpu"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["results.py", "atari5", "--games", "Phoenix", "--savedir", str(tmp_path),
                                      "--keep", str(kept)])
    with pytest.raises(SystemExit) as exit_info:  # as `python scripts/results.py ...` runs: its exit code
        runpy.run_path(str(REPO / "scripts" / "results.py"), run_name="__main__")
    assert exit_info.value.code == code
    error = f"results.py: error: cannot write the session record {run_dir / results.ATARI5_RECORD}: Is a directory"
    assert capsys.readouterr().err.splitlines() == [error, *([last_line] if last_line else [])]
    assert (kept / "atari5-Phoenix.json").is_file() == (stop is not None)  # kept all the same on a stop
