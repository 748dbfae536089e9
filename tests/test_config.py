"""Config: every shipped YAML loads; overrides; each user error is one line naming the key, value and fix."""

from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli_forked
from stride.trainers.config import global_batch_size, global_micro_batch, scaled_lr
from stride.errors import ConfigError
from stride.trainers.config_reader import load_config

SHIPPED = sorted((REPO / "trainers" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_states_its_command(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[:6]
    assert any("python trainers/main.py --config " + str(path.relative_to(REPO)) in line for line in head), \
        f"{path.name} must state its launch command at the top"
    assert cfg.run.name


def test_precedence_command_line_over_yaml_over_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: {batch_size_per_worker: 16, max_steps: 10}\noptim: {lr: 0.01}\n")
    cfg = load_config(p, ["train.max_steps=20", "model.name=mlp", "model.hidden_sizes=[8, 4]", "train.epochs=null"])
    assert cfg.train.max_steps == 20          # command line wins
    assert cfg.train.batch_size_per_worker == 16  # YAML beats the default
    assert cfg.optim.lr == 0.01
    assert cfg.model.hidden_sizes == [8, 4]   # values parsed as YAML
    assert cfg.train.epochs is None
    assert cfg.checkpoint.keep_last == 2      # default


def test_max_steps_null_with_epochs_works():
    cfg = load_config(REPO / "trainers/configs/tabular_mlp.yaml", ["train.max_steps=null", "train.epochs=40"])
    assert cfg.train.max_steps is None and cfg.train.epochs == 40


@pytest.mark.parametrize("overrides, must_name", [
    (["train.bach_size_per_worker=8"], ["train.bach_size_per_worker", "batch_size_per_worker"]),
    (["trian.max_steps=8"], ["trian", "train"]),
    (["train.max_steps=many"], ["train.max_steps", "'many'"]),
    (["optim.lr=-1"], ["optim.lr", "-1", "greater than 0"]),
    (["optim.lr=0"], ["optim.lr", "0"]),
    (["train.batch_size_per_worker=0"], ["train.batch_size_per_worker", "0"]),
    (["train.grad_accum_steps=0"], ["train.grad_accum_steps", "0"]),
    (["train.precision=fp8"], ["train.precision", "fp8", "fp32"]),
    (["train.max_steps=null", "train.epochs=null"], ["train.max_steps", "train.epochs"]),
    (["scaling.num_workers=0"], ["scaling.num_workers", "0"]),
    (["scaling.num_workers=[3,1]"], ["scaling.num_workers", "[3, 1]", "min <= max"]),
    (["scaling.num_workers=[1,2,3]"], ["scaling.num_workers", "[1, 2, 3]", "[min, max]"]),
    (["scaling.num_workers=[2,4]", "train.batch_size_per_worker=32"],
     ["train.batch_size_per_worker (32)", "3 workers", "[2, 4]", "train.batch_size_per_worker=33"]),
    (["run.name=a/b"], ["run.name", "a/b", "path separator"]),
    (["run.storage_path=hdfs://nn/runs"], ["run.storage_path", "hdfs://nn/runs", "scheme", "s3://bucket/prefix"]),
    (["run.storage_path=s3://bucket/a/../b"], ["run.storage_path", "s3://bucket/a/../b", "'..'"]),
    (["model.width=130", "model.n_heads=4"], ["model.width", "130", "n_heads"]),
    (["lr=0.1"], ["section.field=value"]),
    (["optim.betas=[0.9]"], ["optim.betas ([0.9]) needs 2 values, not 1", "optim.betas=[0.9, 0.95]"]),
    (["optim.betas=[0.9, 0.95, 0.99]"], ["optim.betas", "needs 2 values, not 3"]),
])
def test_config_errors_name_key_value_and_fix(overrides, must_name):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "trainers/configs/char_gpt.yaml", overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for part in must_name:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("train: {max_steps: 3\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "sec.yaml").write_text("optimizer: {lr: 1}\n")
    with pytest.raises(ConfigError, match="unknown section 'optimizer'; did you mean optim"):
        load_config(tmp_path / "sec.yaml")


def test_cli_usage_errors_exit_2_with_one_line_and_no_traceback(tmp_path):
    r = run_cli_forked(["trainers/main.py", "--config", "trainers/configs/char_gpt.yaml", "optim.lr=-0.5"], timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "optim.lr" in lines[0] and "-0.5" in lines[0]


def test_cli_print_config_and_help():
    r = run_cli_forked(["trainers/main.py", "--config", "trainers/configs/char_gpt.yaml", "train.max_steps=7",
                        "--print-config"], timeout=60)
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["train"]["max_steps"] == 7 and set(printed) == {
        "run", "data", "init", "model", "optim", "train", "scaling", "checkpoint", "tracking"}
    h = run_cli_forked(["trainers/main.py", "--help"], timeout=60)
    assert h.returncode == 0
    for section in printed:
        assert section in h.stdout


def test_derived_batch_and_lr_scaling():
    base = ["optim.lr=0.001", "optim.reference_batch_size=64", "train.batch_size_per_worker=32", "train.grad_accum_steps=2"]
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml", base + ["optim.lr_scaling=linear"])
    assert global_batch_size(cfg, world_size=2) == 128
    assert scaled_lr(cfg, 2) == pytest.approx(0.002)
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml", base + ["optim.lr_scaling=sqrt"])
    assert scaled_lr(cfg, 2) == pytest.approx(0.001 * 2 ** 0.5)
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml", base + ["optim.lr_scaling=none"])
    assert scaled_lr(cfg, 4) == pytest.approx(0.001)


def test_elastic_runs_keep_the_global_batch_of_max_workers():
    base = ["optim.lr=0.001", "optim.reference_batch_size=64", "train.batch_size_per_worker=48",
            "train.grad_accum_steps=2", "optim.lr_scaling=linear", "scaling.num_workers=[2,4]"]
    cfg = load_config(REPO / "trainers/configs/char_gpt.yaml", base)
    assert cfg.scaling.num_workers == (2, 4)
    # Whatever the gang's size now: 48 x 4 rows per micro-step, split over the workers; the same lr.
    assert [global_micro_batch(cfg, w) for w in (2, 3, 4)] == [192, 192, 192]
    assert [scaled_lr(cfg, w) for w in (2, 3, 4)] == [pytest.approx(0.006)] * 3
    fixed = load_config(REPO / "trainers/configs/char_gpt.yaml", base[:-1] + ["scaling.num_workers=2"])
    assert global_micro_batch(fixed, 2) == 96 and global_batch_size(fixed, 2) == 192


@pytest.mark.parametrize("workers, batch, fit", [("[2,4]", 10, 12), ("[3,5]", 7, 12), ("[1,30]", 32, 77636318760)])
def test_an_elastic_batch_that_cannot_split_names_the_smallest_that_can_at_once(workers, batch, fit):
    import time

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "trainers/configs/char_gpt.yaml", [f"scaling.num_workers={workers}",
                                                              f"train.batch_size_per_worker={batch}"])
    assert time.perf_counter() - t0 < 5  # a linear search up to batch x lcm(1..30) took minutes
    lo, hi = (int(x) for x in workers.strip("[]").split(","))
    assert all(fit * hi % w == 0 for w in range(lo, hi + 1))  # the suggestion splits over every worker count
    assert not any(all(x * hi % w == 0 for w in range(lo, hi + 1)) for x in range(batch, min(fit, batch + 10 ** 5)))
    assert f"use train.batch_size_per_worker={fit}" in str(e.value)


def test_configuration_reference_is_current():
    """docs/configuration.md is generated from the field descriptions: every key of every section and built-in task."""
    from stride.trainers.config import SECTIONS
    from stride.trainers.config_reader import reference_markdown, section_keys
    from stride.trainers.tasks import BUILTIN, task_class

    text = (REPO / "docs" / "configuration.md").read_text()
    assert text == reference_markdown(), "docs/configuration.md is stale: run `make docs`"
    for section, cls in SECTIONS.items():
        for name in section_keys(cls):  # as YAML spells them (init.from)
            assert f"| `{section}.{name}` |" in text
    for task in BUILTIN:
        assert f"### `model.name: {task}`" in text
        for name in task_class(task).Config.model_fields:
            assert f"| `model.{name}` |" in text


# ---- hostile YAML and out-of-range counts (issue 27): refused in one line, quickly, never a hang ---------------

def _bomb_value(levels: int, width: int = 9) -> str:
    """A "billion laughs" value: `levels` anchors, each a list of `width` aliases of the one before."""
    anchors = ["&l0 [lol]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "[" + ", ".join(anchors) + "]"


def _alias_bomb(levels: int) -> str:
    return f"init:\n  include: {_bomb_value(levels)}\n"


def test_yaml_with_a_byte_order_mark_loads(tmp_path):
    p = tmp_path / "bom.yaml"
    p.write_bytes(b"\xef\xbb\xbftrain: {max_steps: 7}\n")
    assert load_config(p).train.max_steps == 7


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("train:\n  max_steps: 10\n  max_steps: 20\n")
    with pytest.raises(ConfigError, match=r"line 3.*key 'max_steps' appears twice in one mapping \(first at line 2\)"):
        load_config(p)
    with pytest.raises(ConfigError, match="key 'a' appears twice"):
        load_config(None, ["model.hidden_sizes={a: 1, a: 2}"])
    # A merge key (<<) overrides by design: not a duplicate.
    p.write_text("optim: {<<: {lr: 0.1}, lr: 0.2}\n")
    assert load_config(p).optim.lr == 0.2


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    import time

    p = tmp_path / "bomb.yaml"
    p.write_text(_alias_bomb(9))  # 9^9 = 387 million values from 300 bytes
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"aliases expand to more than 1000000 values"):
        load_config(p)
    assert time.perf_counter() - t0 < 2
    with pytest.raises(ConfigError, match="aliases expand to more than"):
        load_config(None, ["init.include=" + _bomb_value(9)])
    p.write_text("init: {include: &x [*x]}\n")
    with pytest.raises(ConfigError, match="an alias refers to a node that contains it"):
        load_config(p)


def test_a_smaller_bomb_is_quoted_in_at_most_200_characters(tmp_path):
    p = tmp_path / "small.yaml"
    p.write_text(_alias_bomb(5))  # 66k values: under the limit, over 600 kB as text
    with pytest.raises(ConfigError) as e:
        load_config(p)
    line = str(e.value)
    assert line.startswith("init.include (") and "characters)" in line and len(line) < 600, line[:1000]


@pytest.mark.parametrize("override, bound", [
    ("train.max_steps=1000000000000000000000000000000", "train.max_steps (1000000000000000000000000000000) must be less than or equal to 1000000000"),
    ("train.epochs=1e7", "train.epochs"), ("train.eval_every_steps=10000000000", "train.eval_every_steps"),
    ("train.log_every_steps=10000000000", "train.log_every_steps"), ("checkpoint.every_steps=10000000000", "checkpoint.every_steps"),
    ("optim.warmup_steps=10000000000", "optim.warmup_steps"), ("train.max_nonfinite_steps=10000000000", "train.max_nonfinite_steps"),
    ("train.profile_steps=[1,10000000000]", "train.profile_steps"),
])
def test_step_and_epoch_counts_have_an_upper_bound(override, bound):
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(bound)):
        load_config(None, [override])
    load_config(None, [override.split("=")[0] + "=" + ("[1,1000000000]" if "profile" in override else "1000000")])


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.com", "file:///tmp/mlruns", "/tmp/mlruns",
                                 "mlruns", "databricks", "databricks://profile", "sqlite:///mlflow.db",
                                 "postgresql+psycopg2://u:p@h/db", "mysql://h/db", "mssql+pyodbc://h/db"])
def test_mlflow_uris_mlflow_accepts_are_accepted(uri):
    assert load_config(None, [f"tracking.mlflow_uri={uri}"]).tracking.mlflow_uri == uri


def test_an_mlflow_uri_of_an_unknown_scheme_is_refused_without_its_password():
    with pytest.raises(ConfigError, match=r"^tracking.mlflow_uri \('foo://u:\*\*\*@bar'\) has scheme foo://") as e:
        load_config(None, ["tracking.mlflow_uri=foo://u:secret@bar"])
    assert "secret" not in str(e.value)


def test_a_symlink_loop_storage_path_is_refused(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ConfigError, match=r"^run.storage_path \(.*/a/runs'\) is a loop of symbolic links"):
        load_config(None, [f"run.storage_path={tmp_path}/a/runs"])


def test_the_mlps_old_data_keys_exit_2_naming_their_new_place(tmp_path):
    """data.label_column, data.feature_columns, data.standardize and data.nan_policy are the MLP task's own now
    (model.*): a config that still sets one is refused in one line naming the new key, from YAML or an override."""
    cfg = load_config(REPO / "trainers/configs/tabular_mlp.yaml", ["model.label_column=y", "model.nan_policy=impute"])
    assert cfg.model.label_column == "y" and cfg.model.nan_policy == "impute" and cfg.model.standardize is True
    for key, value in (("label_column", "y"), ("feature_columns", "[a, b]"), ("standardize", "true"),
                       ("nan_policy", "impute")):
        with pytest.raises(ConfigError, match=rf"data\.{key} moved to model\.{key} .*write model\.{key}="):
            load_config(REPO / "trainers/configs/tabular_mlp.yaml", [f"data.{key}={value}"])
    p = tmp_path / "old.yaml"
    p.write_text("model: {name: mlp}\ndata: {label_column: target}\n")
    with pytest.raises(ConfigError, match=r"data\.label_column moved to model\.label_column .*'target'") as e:
        load_config(p)
    assert "\n" not in str(e.value)


def test_a_nested_override_sets_one_key_of_a_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: {early_stopping: {patience: 5}}\n")
    cfg = load_config(p, ["train.early_stopping.min_delta=0.01", "checkpoint.keep_best.k=3"])
    assert cfg.train.early_stopping.min_delta == 0.01 and cfg.train.early_stopping.patience == 5  # the YAML's kept
    assert cfg.checkpoint.keep_best.k == 3 and cfg.checkpoint.keep_best.metric == "val_loss"  # absent: defaults
    with pytest.raises(ConfigError, match=r"unknown key 'train.early_stopping.min_detla'; did you mean min_delta\?"):
        load_config(p, ["train.early_stopping.min_detla=0.01"])
    with pytest.raises(ConfigError, match=r"train.max_steps is a value, not a section .* train.max_steps=<value>"):
        load_config(p, ["train.max_steps.x=1"])


def test_a_token_budget_takes_a_fraction():
    # Manifests give durations in seconds: a budget of 7.5 seconds of audio per worker.
    cfg = load_config(None, ["train.tokens_per_micro_batch=7.5", "data.length_column=duration", "train.max_steps=10"])
    assert cfg.train.tokens_per_micro_batch == 7.5
