"""Tests for impala/config.py: defaults, the command line, validation and the dict round trip."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from impala.config import (
    HELP_GROUPS,
    MODE_FLAGS,
    Config,
    UserError,
    auto_num_actors,
    build_parser,
    changed_flags,
    config_from_dict,
    cpu_quota,
    first_line,
    given_flags,
    ignored_flags_line,
    memory_limit,
    parse_config,
    run_path,
    unused_training_flags_line,
    usable_cores,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_atari_settings_measured_in_results() -> None:
    """PPO's clipped surrogate on V-trace advantages with CleanRL's Atari settings (RESULTS.md)."""
    config = Config()
    assert config.mode == "train"
    assert config.env == "PongNoFrameskip-v4"
    assert (config.unroll_length, config.batch_size, config.envs_per_actor) == (32, 32, 8)
    # --num_actors auto: the cores less the learner's and the main process's, at least one batch's worth (4).
    assert config.num_actors == max(usable_cores() - 2, 4)
    assert (config.policy_loss, config.ppo_clip, config.epochs, config.minibatches) == ("ppo", 0.1, 2, 8)
    assert (config.ppo_dual_clip, config.num_learner_threads, config.num_buffers) == (3.0, 1, None)
    assert (config.optimizer, config.learning_rate, config.epsilon) == ("adam", 0.00025, 1e-5)
    assert config.lr_schedule == "constant"
    assert (config.entropy_cost, config.vtrace_lambda) == (0.01, 0.95)
    assert (config.baseline_cost, config.discounting, config.grad_norm_clipping) == (0.5, 0.99, 0.5)
    assert config.total_steps == 5_000_000
    assert config.reward_clipping == "abs_one"
    assert config.episodic_life is True
    assert config.use_lstm is False
    assert config.validate() == []


def test_derived_values() -> None:
    config = Config(num_actors=3, envs_per_actor=5, num_learner_threads=2, batch_size=4, unroll_length=20)
    assert config.slots_needed == 3 * 5 + 2 * 4
    assert config.resolved_num_buffers() == config.slots_needed  # actors at most about one batch ahead
    assert Config(num_buffers=100).resolved_num_buffers() == 100
    assert Config(num_buffers=100).resolved_num_buffers(learner_keeps_up=True) == 100  # the flag wins
    assert config.steps_per_update == 20 * 4


@pytest.mark.parametrize("num_actors, envs_per_actor, batch_size, learner_threads, slower, keeps_up", [
    (14, 8, 32, 1, 14 * 8 + 32, 2 * 14 * 8),  # one GPU machine's default (graphed): two unrolls per env
    (4, 8, 32, 1, 64, 64),  # two cores' default: slots_needed already holds two unrolls per env
    (2, 8, 32, 2, 16 + 64, 16 + 64),  # more than two unrolls per env: never fewer than slots_needed
    (3, 5, 4, 1, 19, 30),
])
def test_a_learner_that_keeps_up_gives_every_env_two_unrolls_of_slots(num_actors: int, envs_per_actor: int,
                                                                     batch_size: int, learner_threads: int, slower: int,
                                                                     keeps_up: int) -> None:
    config = Config(num_actors=num_actors, envs_per_actor=envs_per_actor, batch_size=batch_size,
                    num_learner_threads=learner_threads)
    assert config.resolved_num_buffers() == config.resolved_num_buffers(learner_keeps_up=False) == slower
    assert config.resolved_num_buffers(learner_keeps_up=True) == keeps_up


@pytest.mark.parametrize("cores, local_ranks, batch_size, envs_per_actor, other_actors, expected", [
    (16, 1, 32, 8, 0, 14),  # one GPU machine: 14 actors, a core for the learner, one for the main process
    (2, 1, 32, 8, 0, 4),  # two cores: still the 4 actors whose 32 envs fill one batch of 32 unrolls
    (2, 1, 64, 8, 0, 8),
    (2, 1, 30, 8, 0, 4),  # ceil(30 / 8)
    (16, 2, 32, 8, 0, 6),  # two learner ranks on the machine (torchrun): each takes half
    (16, 1, 32, 8, 2, 12),  # --ray local's 2 remote actors are processes of this machine too
    (64, 1, 32, 8, 0, 62),
    (2, 1, 0, 8, 0, 1),  # an invalid batch size: one actor, and --batch_size is the one problem reported
])
def test_auto_num_actors(cores: int, local_ranks: int, batch_size: int, envs_per_actor: int, other_actors: int,
                         expected: int) -> None:
    assert auto_num_actors(cores, local_ranks, batch_size, envs_per_actor, other_actors) == expected


def _cores(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    """This process may run on `cores` cores, with no cgroup CPU quota."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr("impala.config.cpu_quota", lambda: None)


def _cgroup_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_cpu_quota_is_the_smallest_of_the_process_cgroup_and_those_above_it(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    proc.write_text("0::/kubepods/pod1/container\n")  # cgroup v2
    _cgroup_files(root, {"kubepods/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "250000 100000\n",
                         "kubepods/pod1/container/cpu.max": "max 100000\n"})
    assert cpu_quota(proc, root) == 2.5  # the pod's limit, above the container's own cgroup
    _cgroup_files(root, {"kubepods/pod1/container/cpu.max": "150000 100000\n"})
    assert cpu_quota(proc, root) == 1.5
    _cgroup_files(root, {"kubepods/pod1/container/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "max 100000\n"})
    assert cpu_quota(proc, root) is None  # no quota anywhere
    proc.write_text("0::/\n")  # a container in its own cgroup namespace: its cgroup is the mount point
    _cgroup_files(root, {"cpu.max": "400000 100000\n"})
    assert cpu_quota(proc, root) == 4.0
    proc.write_text("0::/docker/abc\n")  # no cgroup namespace: the path is the host's, the mount the container's
    assert cpu_quota(proc, root) == 4.0


def test_the_memory_limit_is_the_smallest_of_the_process_cgroup_and_those_above_it(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    proc.write_text("0::/kubepods/pod1/container\n")  # cgroup v2
    _cgroup_files(root, {"kubepods/memory.max": "max\n", "kubepods/pod1/memory.max": "8589934592\n",
                         "kubepods/pod1/container/memory.max": "max\n"})
    assert memory_limit(proc, root) == 8 * 2**30  # the pod's limit, above the container's own cgroup
    _cgroup_files(root, {"kubepods/pod1/container/memory.max": "4294967296\n"})
    assert memory_limit(proc, root) == 4 * 2**30
    _cgroup_files(root, {"kubepods/pod1/container/memory.max": "max\n", "kubepods/pod1/memory.max": "max\n"})
    assert memory_limit(proc, root) is None  # no limit anywhere
    proc.write_text("0::/\n")  # a container in its own cgroup namespace: its cgroup is the mount point
    _cgroup_files(root, {"memory.max": "2147483648\n"})
    assert memory_limit(proc, root) == 2 * 2**30


def test_the_memory_limit_of_cgroup_v1_and_what_cannot_be_read(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    proc.write_text("5:memory:/jobs/7\n4:cpu,cpuacct:/jobs/7\n0::/\n")  # v1 beside an empty v2 hierarchy
    _cgroup_files(root, {"memory/jobs/7/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
                         "memory/jobs/memory.limit_in_bytes": "3221225472\n"})
    assert memory_limit(proc, root) == 3 * 2**30
    assert cpu_quota(proc, root) is None  # the memory controller's limit is not the cpu controller's
    _cgroup_files(root, {"memory/jobs/memory.limit_in_bytes": "garbage\n"})
    assert memory_limit(proc, root) is None
    assert memory_limit(tmp_path / "missing", root) is None
    proc.write_text("not a cgroup line\n")
    assert memory_limit(proc, root) is None


def test_the_cpu_quota_of_cgroup_v1_and_what_cannot_be_read(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    proc.write_text("5:memory:/jobs/7\n4:cpu,cpuacct:/jobs/7\n0::/\n")  # v1 beside an empty v2 hierarchy
    _cgroup_files(root, {"cpu,cpuacct/jobs/7/cpu.cfs_quota_us": "-1\n",
                         "cpu,cpuacct/jobs/7/cpu.cfs_period_us": "100000\n",
                         "cpu,cpuacct/jobs/cpu.cfs_quota_us": "300000\n",
                         "cpu,cpuacct/jobs/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(proc, root) == 3.0
    _cgroup_files(root, {"cpu,cpuacct/jobs/cpu.cfs_quota_us": "garbage\n"})
    assert cpu_quota(proc, root) is None
    assert cpu_quota(tmp_path / "missing", root) is None
    proc.write_text("not a cgroup line\n")
    assert cpu_quota(proc, root) is None


def test_usable_cores_are_the_affinitys_capped_by_the_quota_in_whole_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    for quota, cores in ((None, 64), (4.0, 4), (2.5, 2), (0.5, 1), (100.0, 64)):
        monkeypatch.setattr("impala.config.cpu_quota", lambda quota=quota: quota)
        assert usable_cores() == cores
    monkeypatch.setattr("impala.config.cpu_quota", lambda: 6.0)  # docker run --cpus 6 on a 64-core host
    assert parse_config([]).num_actors == 4  # 6 - 2 = 4, as on a machine of 6 cores (not 62 actors)


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(not (V1_CPU / "cpu.cfs_quota_us").is_file() or not os.access(V1_CPU, os.W_OK),
                    reason="needs a writable cgroup v1 cpu hierarchy (root)")
def test_a_real_cgroup_quota_caps_the_usable_cores(tmp_path: Path) -> None:
    group = V1_CPU / f"impala-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")  # half a core
        code = "from impala.config import cpu_quota, usable_cores; print(cpu_quota(), usable_cores())"
        result = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
                                 code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["0.5", "1"]
    finally:
        group.rmdir()


def test_an_invalid_batch_size_on_few_cores_is_reported_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 2)  # auto: no core to spare
    with pytest.raises(UserError) as error:
        parse_config(["--batch_size", "0", "--num_actors", "auto"])
    assert "--num_actors" not in str(error.value)
    assert "--batch_size must be >= 1, got 0" in str(error.value)


def test_num_actors_auto_is_resolved_once_from_this_process_share(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 16)
    assert parse_config([]).num_actors == 14
    assert parse_config(["--num_actors", "auto"]).num_actors == 14
    assert parse_config(["--num_actors", "3"]).num_actors == 3  # an explicit number is kept, whatever the cores
    assert parse_config(["--ray", "local", "--ray_actors", "5"]).num_actors == 9
    assert parse_config(["--ray", "auto", "--ray_actors", "5"]).num_actors == 14  # remote: another machine's cores
    config = parse_config(["--batch_size", "8"])
    assert config.to_dict()["num_actors"] == 14  # flags.json and checkpoints keep the number, not "auto"
    assert config_from_dict(config.to_dict()).num_actors == 14
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun, 4 ranks on this machine
    assert parse_config([]).num_actors == 4  # 16 / 4 - 2 = 2, but one batch needs 32 / 8 = 4


@pytest.mark.parametrize("value", ["-1", "-3", "four", "2.5", ""])
def test_num_actors_takes_a_number_or_auto(value: str) -> None:
    with pytest.raises(UserError, match="--num_actors"):
        parse_config(["--num_actors", value])


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().batch_size = 3  # type: ignore[misc]


def test_parse_config_without_flags_gives_defaults() -> None:
    assert parse_config([]) == Config()


def test_parse_config_reads_every_kind_of_flag() -> None:
    config = parse_config([
        "--env", "CartPole-v1", "--num_actors", "2", "--learning_rate", "0.001", "--use_lstm",
        "--no-episodic_life", "--model", "mlp", "--num_buffers", "100", "--plot_xpids", "a", "b",
        "--xpid", "run-1",
    ])
    assert config.env == "CartPole-v1"
    assert config.num_actors == 2
    assert config.learning_rate == 0.001
    assert config.use_lstm is True
    assert config.episodic_life is False
    assert config.model == "mlp"
    assert config.num_buffers == 100
    assert config.plot_xpids == ("a", "b")
    assert config.xpid == "run-1"


@pytest.mark.parametrize("value, number", [("5000000", 5_000_000), ("5_000_000", 5_000_000), ("5e6", 5_000_000),
                                           ("1.5E7", 15_000_000), ("2.0e3", 2000)])
def test_whole_number_flags_take_a_floats_notation_too(value: str, number: int) -> None:
    config = parse_config(["--total_steps", value, "--eval_max_steps", value])
    assert (config.total_steps, config.eval_max_steps) == (number, number)
    assert type(config.total_steps) is int


def test_num_actors_takes_auto_or_a_whole_number_in_either_notation() -> None:
    assert [parse_config(["--num_actors", value]).num_actors for value in ("1", "3", "3.0", "1e1")] == [1, 3, 3, 10]
    for value in ("1.5", "-1", "many", ""):
        with pytest.raises(UserError, match=rf"^argument --num_actors: takes a number >= 0 or auto, got '{value}'$"):
            parse_config(["--num_actors", value])


@pytest.mark.parametrize("value", ["1.5", "2.5e-1", "5M", "inf", "nan", "1e6x", ""])
def test_a_whole_number_flag_refuses_anything_else_in_one_line(value: str) -> None:
    with pytest.raises(UserError, match=rf"^argument --total_steps: takes a whole number \(such as 5000000 or 5e6\), "
                                        rf"got '{value}'$"):
        parse_config(["--total_steps", value])


def test_help_lists_every_field_with_its_default() -> None:
    env = {**os.environ, "COLUMNS": "400"}  # one line per flag, so a default is never wrapped away
    result = subprocess.run([sys.executable, "run.py", "--help"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for f in dataclasses.fields(Config):
        assert f"--{f.name}" in text, f"--{f.name} missing from --help"
        assert f.metadata["help"].split()[0] in text
        default = f.metadata.get("argparse_default", f.default)  # --num_actors: auto
        if isinstance(default, bool) and f.metadata.get("negatable"):
            assert f"--no-{f.name}" in text
        # argparse writes the default after the flag's help text, unless that gives it itself.
        help_words = " ".join(f.metadata["help"].split())
        if "default:" in help_words:
            assert f"{help_words} --" in text or text.endswith(help_words), f"--{f.name}: a second default shown"
        else:
            assert f"{help_words} (default: {default})" in text, f"--{f.name}: default {default} not shown after help"


def test_help_lists_the_flags_by_topic_in_the_order_of_the_fields() -> None:
    parser = build_parser()
    groups = {group.title: [action.dest for action in group._group_actions] for group in parser._action_groups}
    titles = [title for title, _ in HELP_GROUPS.values()]
    assert list(groups) == ["positional arguments", "options", *titles]
    assert groups["positional arguments"] == [] and groups["options"] == ["help"]  # -h alone outside the topics
    assert groups["acting"][:2] == ["num_actors", "envs_per_actor"]
    assert "checkpoint" in groups["what to run"] and "resume" in groups["what to run"]
    assert groups["test and plot modes"] == ["test_episodes", "video", "plot_out", "plot_xpids", "plot_x"]
    grouped = [name for title in titles for name in groups[title]]
    assert grouped == [f.name for f in dataclasses.fields(Config)]  # every flag once, in the fields' order
    help_text = parser.format_help()
    assert help_text.startswith("usage: run.py [--mode {train,test,plot}] [--env ENV] [--xpid XPID] [FLAG ...] [@FILE ...]\n")
    assert help_text.index("\nacting:\n") < help_text.index("--num_actors") < help_text.index("\nremote actors on")


def test_validate_reports_non_positive_sizes_with_numbers() -> None:
    problems = Config(num_actors=0, unroll_length=-3, hidden_size=0, learning_rate=0.0).validate()
    text = "\n".join(problems)
    assert "--num_actors must be >= 1, got 0" in text
    assert "--unroll_length must be >= 1, got -3" in text
    assert "--hidden_size must be >= 1, got 0" in text
    assert "--learning_rate must be > 0, got 0.0" in text
    assert len(problems) == 4


@pytest.mark.parametrize("name", ["num_actors", "envs_per_actor", "env_splits", "inference_threads", "unroll_length",
                                  "total_steps", "batch_size", "num_learner_threads", "hidden_size", "test_episodes"])
def test_validate_rejects_each_non_positive_size(name: str) -> None:
    problems = Config(**{name: 0}).validate()
    assert any(f"--{name}" in p and "0" in p for p in problems), problems


def test_validate_reports_ranges() -> None:
    text = "\n".join(Config(discounting=1.5, alpha=1.0, entropy_cost=-0.1).validate())
    assert "--discounting must be in [0, 1], got 1.5" in text
    assert "--alpha must be in [0, 1), got 1.0" in text
    assert "--entropy_cost must be >= 0, got -0.1" in text


FLOAT_FLAGS = [f.name for f in dataclasses.fields(Config) if isinstance(getattr(Config(), f.name), float)]


@pytest.mark.parametrize("name", FLOAT_FLAGS)
def test_validate_rejects_nan_for_every_number_in_one_message(name: str) -> None:
    """NaN passes every `value < bound` check; it is reported once, as what it is."""
    assert Config(**{name: math.nan}).validate() == [f"--{name} must be a number, got nan"]


def test_validate_rejects_infinity_where_it_means_nothing_and_keeps_it_where_it_means_never() -> None:
    text = "\n".join(Config(learning_rate=math.inf, entropy_cost=math.inf, inference_wait_ms=math.inf).validate())
    assert "--learning_rate must be finite, got inf" in text  # it turned every weight to NaN after one update
    assert "--entropy_cost must be finite, got inf" in text
    assert "--inference_wait_ms must be finite, got inf" in text  # the inference thread failed at its first batch
    assert Config(checkpoint_interval_s=math.inf, actor_timeout_s=math.inf, eval_interval_s=math.inf,
                  grad_norm_clipping=math.inf, log_interval_s=math.inf).validate() == []


def test_validate_reports_too_few_buffers_with_the_arithmetic() -> None:
    config = Config(num_actors=3, envs_per_actor=4, num_learner_threads=2, batch_size=5, num_buffers=21)
    problems = config.validate()
    assert len(problems) == 1
    (problem,) = problems
    # 3 x 4 + 2 x 5 = 22 slots can be held at once.
    for number in ("21", "3 actors", "4 envs", "2 learner threads", "batch 5", "22"):
        assert number in problem, (number, problem)
    assert Config(num_actors=3, envs_per_actor=4, num_learner_threads=2, batch_size=5, num_buffers=22).validate() == []


def test_validate_reports_contradictory_flags() -> None:
    assert any("--mode test needs --xpid" in p for p in Config(mode="test").validate())
    assert any("--resume needs --xpid" in p for p in Config(resume=True).validate())
    assert any("--use_lstm" in p and "central" in p for p in Config(use_lstm=True, inference="central").validate())
    assert Config(mode="test", xpid="x").validate() == []
    assert Config(use_lstm=True, inference="actor").validate() == []
    for config in (Config(minibatch_mode="samples", use_lstm=True), Config(minibatch_mode="samples", policy_loss="impala")):
        assert any("--minibatch_mode samples needs" in p for p in config.validate())
    assert Config(minibatch_mode="samples").validate() == []


def test_validate_reports_more_inference_threads_than_env_splits_to_serve() -> None:
    central = {"inference": "central", "num_actors": 2, "envs_per_actor": 4, "env_splits": 2}
    assert Config(**central, inference_threads=5).validate() == [
        "--inference_threads 5 is more than the 4 env splits there are to serve (--num_actors 2 x --env_splits 2)"]
    assert Config(**central, inference_threads=4).validate() == []
    assert Config(**{**central, "inference": "actor"}, inference_threads=5).validate() == []  # unused there


def test_validate_reports_every_problem_at_once() -> None:
    config = Config(num_actors=0, batch_size=0, discounting=2.0, mode="test", use_lstm=True, inference="central")
    problems = config.validate()
    assert len(problems) == 5, problems
    assert any("--xpid 'bad name!'" in p for p in Config(xpid="bad name!").validate())


def test_parse_config_raises_user_error_naming_every_problem() -> None:
    with pytest.raises(UserError) as info:
        parse_config(["--num_actors", "0", "--batch_size", "-2"])
    message = str(info.value)
    assert "--num_actors must be >= 1, got 0" in message
    assert "--batch_size must be >= 1, got -2" in message
    assert "\n" not in message


@pytest.mark.parametrize(("argv", "message"), [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--num_actors", "two"], "argument --num_actors: takes a number >= 0 or auto, got 'two'"),
    (["--model", "transformer"], "argument --model: invalid choice: 'transformer'"),
])
def test_parse_config_raises_user_error_for_bad_flags(argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        parse_config(argv)


def test_run_py_reports_a_bad_flag_in_one_line_with_exit_code_2() -> None:
    result = subprocess.run([sys.executable, "run.py", "--num_actors", "0"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["run.py: error: --num_actors must be >= 1, got 0"]
    assert "Traceback" not in result.stderr


def test_dict_round_trip() -> None:
    for config in (Config(), Config(env="CartPole-v1", num_buffers=30, plot_xpids=("a", "b"), use_lstm=True)):
        values = config.to_dict()
        assert config_from_dict(values) == config
        assert isinstance(values["plot_xpids"], list)  # JSON-friendly
    values = {**Config().to_dict(), "a_flag_from_an_older_version": 1}
    assert config_from_dict(values) == Config()


def test_parser_has_one_flag_per_field() -> None:
    parser = build_parser()
    dests = {action.dest for action in parser._actions} - {"help"}
    assert dests == {f.name for f in dataclasses.fields(Config)}


def test_xpid_latest_is_the_run_named_in_the_latest_file(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("pong-3\n")
    (tmp_path / "pong-3").mkdir()
    assert run_path(tmp_path, "latest") == tmp_path / "pong-3"
    assert run_path(tmp_path, "pong-1") == tmp_path / "pong-1"
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()  # a run that is itself called latest keeps its name
    assert run_path(tmp_path, "latest") == tmp_path / "latest"


def test_given_flags_are_the_ones_on_the_command_line_abbreviated_or_not() -> None:
    assert given_flags(["--env", "CartPole-v1", "--num_act", "3", "--no-amp", "--xpid", "a"]) == {
        "env", "num_actors", "amp", "xpid"}
    assert given_flags([]) == set()


def test_a_flags_file_stands_for_its_flags_and_later_flags_override_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cartpole.flags").write_text(
        "# CartPole, quickly\n--env CartPole-v1 --num_actors 2  # two actors\n"
        "--envs_per_actor 4\n--xpid 'cart.1'\n@more.flags\n")
    (tmp_path / "more.flags").write_text('--learning_rate 0.001 --policy_loss "impala"\n--seed 5')
    monkeypatch.chdir(tmp_path)  # a file inside a file is read from the working directory, as on the command line
    config = parse_config(["@cartpole.flags", "--seed", "7"])
    assert config == parse_config(["--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "4", "--xpid",
                                   "cart.1", "--learning_rate", "0.001", "--policy_loss", "impala", "--seed", "7"])
    assert config.seed == 7 and config.num_actors == 2
    assert given_flags(["@cartpole.flags"]) == {"env", "num_actors", "envs_per_actor", "xpid", "learning_rate",
                                                "policy_loss", "seed"}
    assert parse_config(["@cartpole.flags", "--num_actors", "3"]).num_actors == 3


@pytest.mark.parametrize(("content", "pattern"), [
    (None, r"^flags file .*absent.flags: No such file or directory$"),
    (b"--env \xff\xfe", r"^flags file .*bad.flags is not UTF-8 text$"),
    (b"--xpid 'open", r"^flags file .*bad.flags: no closing quotation$"),
    (b"--env CartPole-v1 @bad.flags", r"^flags file bad.flags: flags files name one another more than 8 deep"),
    (b"--num_actors two", r"^argument --num_actors: takes a number >= 0 or auto, got 'two'$"),
])
def test_a_flags_file_that_cannot_be_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      content: bytes | None, pattern: str) -> None:
    monkeypatch.chdir(tmp_path)
    name = "absent.flags" if content is None else "bad.flags"
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=pattern):
        parse_config([f"@{name}"])
    with pytest.raises(UserError, match=r"^flags file @: the name after @ is empty$"):
        parse_config(["@"])


def test_changed_flags_name_each_difference_but_the_sessions_own() -> None:
    config = parse_config(["--env", "CartPole-v1", "--num_actors", "2", "--total_steps", "900", "--xpid", "a",
                           "--plot_xpids", "a", "b"])
    saved = {**config.to_dict(), "total_steps": 500, "xpid": "b", "plot_xpids": [], "num_actors": 4,
             "amp": True, "world_size": 2}
    saved.pop("seed")  # a flag the run's version did not have
    assert changed_flags(saved, config) == ["--num_actors 2 (was 4)", "--amp default (was True)"]
    assert changed_flags(config.to_dict(), config) == []


def test_xpid_latest_without_a_latest_run_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--xpid latest: no run in"):
        run_path(tmp_path, "latest")
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(UserError, match="--xpid latest: no run in"):
        run_path(tmp_path, "latest")


def test_an_exceptions_first_line_skips_leading_blank_lines_and_names_its_type_when_it_has_no_text() -> None:
    assert first_line(RuntimeError("\n  CUDA error: out of memory\nCompile with TORCH_USE_CUDA_DSA")) == \
        "CUDA error: out of memory"
    assert first_line(ValueError("  \n ")) == "ValueError"
    assert first_line(KeyError()) == "KeyError"


# ------------------------------------------------------------------------- flags a mode does not use


def _reading(config: Config) -> tuple[Config, set[str]]:
    """A copy of `config` that records which flags are read from it (except by `to_dict`, which copies them all
    into a log), and the set it records them in."""
    names, read = {setting.name for setting in dataclasses.fields(Config)}, set()

    class Reading(Config):
        def __getattribute__(self, name: str) -> object:
            if name in names:
                read.add(name)
            return object.__getattribute__(self, name)

        def to_dict(self) -> dict[str, object]:
            before = set(read)
            values = super().to_dict()
            read.intersection_update(before)
            return values

    copy = Reading(**{name: getattr(config, name) for name in names})
    read.clear()
    return copy, read


def test_test_mode_reads_no_flag_it_says_it_ignores(tmp_path: Path) -> None:
    from impala.checkpoint import CHECKPOINT_NAME, save_checkpoint
    from impala.evaluate import test
    from impala.model import Net

    (tmp_path / "c").mkdir()
    save_checkpoint(tmp_path / "c" / CHECKPOINT_NAME, {
        "model_state_dict": Net((4,), 2, "mlp", False, 32).state_dict(), "step": 40, "model": "mlp",
        "flags": {"env": "CartPole-v1", "hidden_size": 32}, "observation_shape": [4], "num_actions": 2})
    config, read = _reading(parse_config(["--mode", "test", "--env", "CartPole-v1", "--savedir", str(tmp_path),
                                          "--xpid", "c", "--test_episodes", "1", "--video"]))
    test(config)
    assert {"env", "seed", "test_episodes", "eval_actions", "eval_max_steps", "video"} <= read <= MODE_FLAGS["test"]
    assert ignored_flags_line("test", frozenset(MODE_FLAGS["test"])) is None


def test_plot_mode_reads_no_flag_it_says_it_ignores(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from impala.plotting import RETURN_TAG, plot

    with SummaryWriter(str(tmp_path / "r")) as writer:
        for step in range(0, 400, 40):
            writer.add_scalar(RETURN_TAG, step / 10, step)
    config, read = _reading(parse_config(["--mode", "plot", "--savedir", str(tmp_path), "--xpid", "r",
                                          "--plot_out", str(tmp_path / "r.png")]))
    plot(config)
    assert {"savedir", "plot_xpids", "plot_out", "plot_x"} <= read <= MODE_FLAGS["plot"]


def test_flags_test_or_plot_mode_does_not_use_are_named_in_one_line_once_it_is_done(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from torch.utils.tensorboard import SummaryWriter

    import run
    from impala.plotting import RETURN_TAG

    argv = ["--mode", "plot", "--savedir", str(tmp_path), "--plot_x", "time"]
    assert run.main([*argv, "--total_steps", "5", "--env", "CartPole-v1"]) == 2  # nothing to plot: one line, the error
    assert capsys.readouterr().err.startswith("run.py: error: no runs")
    with SummaryWriter(str(tmp_path / "r")) as writer:
        writer.add_scalar(RETURN_TAG, 1.0, 40)
    assert run.main([*argv, "--total_steps", "5", "--env", "CartPole-v1"]) == 0
    assert capsys.readouterr().err == "run.py: --mode plot does not use --env, --total_steps; ignored\n"
    assert run.main(argv) == 0
    assert capsys.readouterr().err == ""
    assert ignored_flags_line("train", frozenset({"plot_x", "video"})) is None  # training: every flag its own


def test_training_flags_that_count_only_beside_another_are_named_when_that_one_is_missing() -> None:
    """--ray_actors without --ray, --inference_threads without --inference central: accepted, and nothing used
    them; test and plot mode already named what they ignore."""
    argv = ["--ray_actors", "3", "--ray_publish_every", "2", "--inference_threads", "2"]
    assert unused_training_flags_line(parse_config(argv), given_flags(argv)) == (
        "run.py: --ray_actors, --ray_publish_every only with --ray; --inference_threads only with --inference "
        "central: ignored")
    central = [*argv, "--inference", "central", "--env_splits", "2"]
    assert unused_training_flags_line(parse_config(central), given_flags(central)) == (
        "run.py: --ray_actors, --ray_publish_every only with --ray: ignored")
    assert unused_training_flags_line(parse_config([]), given_flags([])) is None
    impala_loss = ["--policy_loss", "impala", "--ppo_clip", "0.2", "--advantage_norm", "batch", "--epochs", "1"]
    assert unused_training_flags_line(parse_config(impala_loss), given_flags(impala_loss)) == (
        "run.py: --ppo_clip, --advantage_norm only with --policy_loss ppo: ignored")


def test_say_goes_on_quietly_once_the_reader_of_stdout_is_gone() -> None:
    """`run.py --mode test ... | head -1`: the lines after the reader left go nowhere, and the mode's work after
    them (a video to write) is done, rather than a BrokenPipeError's traceback."""
    script = ("import sys; from impala.config import say; sys.stdin.read(); "
              "[say('a line of results') for _ in range(3)]; print('went on', file=sys.stderr)")
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=REPO_ROOT)
    assert child.stdout is not None and child.stdin is not None and child.stderr is not None
    child.stdout.close()  # the reader is gone before the first line
    child.stdin.close()
    assert child.wait(timeout=60) == 0
    assert child.stderr.read() == b"went on\n"
