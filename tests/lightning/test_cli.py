"""The CLI's edges: ``vars`` typos and types, interpolation errors, packaged config names, ``predict``.

In-process: ``--print_config`` parses everything and exits without building a Trainer.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from cephalo_lightning.__main__ import main as module_main
from cephalo_lightning.lightning.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cli.yaml"


def _print_config(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None), out.getvalue()[-2000:]
    return yaml.safe_load(out.getvalue())


def _error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


def test_vars_from_the_command_line_keep_their_yaml_types(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(TINY.read_text().replace("vars:\n", "vars:\n  lr: 0.1\n  name: a\n"))
    parsed = _print_config("--config", str(config), "--vars.steps=40", "--vars.lr=0.5", "--vars.name=b")
    assert parsed["vars"] == {"steps": 40, "batch": 8, "lr": 0.5, "name": "b"}
    assert parsed["trainer"]["max_steps"] == 40


@pytest.mark.parametrize(("written", "read"), [("rank0", "rank0"), ("none", "none"), ("false", False), ("true", True)])
def test_gather_on_teardown_is_read_from_yaml_as_its_choice_or_a_bool(written, read):
    parsed = _print_config("--config", str(TINY), f"--trainer.strategy.init_args.gather_on_teardown={written}")
    assert parsed["trainer"]["strategy"]["init_args"]["gather_on_teardown"] == read


def test_a_misspelt_var_is_an_error_naming_the_known_ones(capsys):
    err = _error(capsys, "--config", str(TINY), "--vars.stepz=99")
    assert err.startswith("error: unknown var in --vars.stepz") and "batch, steps" in err


def test_an_unresolvable_interpolation_is_one_line(tmp_path, capsys):
    config = tmp_path / "typo.yaml"
    config.write_text(TINY.read_text().replace("max_steps: ${vars.steps}", "max_steps: ${vars.typo}"))
    err = _error(capsys, "--config", str(config))
    assert err == ("error: ${vars.typo} at trainer.max_steps does not resolve (no such key); "
                   "the config's vars are batch, steps.")


# (where the typo is, how it is written, the typo, the option as the message names it, the option meant): by hand
MISSPELT_OPTIONS = [
    ("config", "max_steps: ${vars.steps}", "max_step: ${vars.steps}", "trainer.max_step", "trainer.max_steps"),
    ("config", "enable_progress_bar: false", "enable_progres_bar: false", "trainer.enable_progres_bar",
     "trainer.enable_progress_bar"),
    ("config", "seed_everything: 0", "seed_everythin: 0", "seed_everythin", "seed_everything"),
    ("config", "    preset: tiny", "    presett: tiny", "model.init_args.presett", "model.init_args.preset"),
    ("config", "      mode: layered", "      mod: layered", "trainer.strategy.init_args.mod",
     "trainer.strategy.init_args.mode"),
    ("flag", None, "--trainer.max_stesp=5", "trainer.max_stesp", "trainer.max_steps"),
]


@pytest.mark.parametrize("where, written, typo, key, meant", MISSPELT_OPTIONS, ids=[m[3] for m in MISSPELT_OPTIONS])
def test_a_misspelt_option_is_one_error_line_naming_it_and_the_nearest(tmp_path, capsys, where, written, typo, key,
                                                                       meant):
    """docs/reference/cli.md promises one ``error:`` line; jsonargparse prints the usage of every
    option of the subcommand (a misspelt class_path argument: some 60 lines) above its message."""
    if where == "config":
        config = tmp_path / "typo.yaml"
        config.write_text(TINY.read_text().replace(written, typo))
        err = _error(capsys, "--config", str(config))
    else:
        err = _error(capsys, "--config", str(TINY), typo)
    assert err.startswith(f"error: unknown option {key!r} ("), err
    assert f"; did you mean {meant!r}? --" in err and err.endswith(("lists the options", "lists its options")), err


def test_a_bad_value_is_one_error_line_naming_the_option(capsys):
    err = _error(capsys, "--config", str(TINY), "--trainer.max_steps=many")
    assert err.startswith("error: ") and "trainer.max_steps" in err and "many" in err, err


def test_a_packaged_config_is_found_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = _print_config("--config", "quickstart")
    by_path = _print_config("--config", str(ROOT / "configs" / "quickstart.yaml"))
    assert by_name == by_path and by_name["trainer"]["devices"] == 2


def test_predict_is_a_command_of_python_dash_m_as_of_cephalo_train(capsys):
    with pytest.raises(SystemExit) as exit_info:
        module_main(["predict", "--help"])
    assert exit_info.value.code == 0
    assert "predict" in capsys.readouterr().out
    assert module_main(["--help"]) == 0 and "predict" in capsys.readouterr().out


def test_predict_on_the_demo_datamodule_scores_every_held_out_window(tmp_path, monkeypatch):
    import torch

    from cephalo_lightning.demo import GPT, GPTModule
    from cephalo_lightning.lightning.cli import run_cli

    monkeypatch.chdir(tmp_path)
    cli = run_cli(["predict", "--config", str(TINY)])
    predictions = cli.trainer.predict_loop.predictions
    windows = list(cli.datamodule.predict_dataloader())
    assert len(predictions) == len(windows) and all(p["nll"].shape == (len(w[0]),) for p, w in zip(predictions, windows))
    # the same weights in a plain module give the same loss on the same windows
    plain = GPTModule(preset="tiny", seq_len=32)
    plain.configure_model()
    plain.load_state_dict(cli.trainer.strategy.sharded.full_state_dict(), strict=False)
    x, y = windows[0]
    with torch.no_grad():
        want = GPT.loss(plain(x), y)
        next_token = plain(x)[:, -1].argmax(dim=-1)
    # one mean of every token's loss vs the mean of per-window means: fp32 summation order only,
    # bounded by (tokens summed) x eps
    assert torch.allclose(predictions[0]["nll"].mean(), want, rtol=x.numel() * torch.finfo(torch.float32).eps, atol=0)
    assert torch.equal(predictions[0]["next_token"], next_token)


def test_the_help_of_cephalo_train_and_profile_says_what_they_are_and_take(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cephalo-lightning" in out and "heterogeneous GPU clusters" in out and "--config quickstart" in out
    with pytest.raises(SystemExit) as exit_info:
        module_main(["profile", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--plan-output" in out and "LightningCLI" in out


def test_a_wandb_logger_without_wandb_becomes_a_csv_logger_in_its_directory(monkeypatch):
    from jsonargparse import Namespace

    from cephalo_lightning.lightning import cli_loggers

    def trainer_config() -> Namespace:
        wandb = Namespace(class_path=cli_loggers.WANDB_LOGGER, init_args=Namespace(project="p", save_dir="out", offline=True))
        tensorboard = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace(save_dir="tb"))
        return Namespace(logger=[wandb, tensorboard], default_root_dir="root")

    installed = trainer_config()
    monkeypatch.setattr(cli_loggers, "wandb_installed", lambda: True)
    assert cli_loggers.replace_missing_wandb(installed) == [] and installed == trainer_config()
    missing = trainer_config()
    monkeypatch.setattr(cli_loggers, "wandb_installed", lambda: False)
    with pytest.warns(UserWarning, match=r'wandb is not installed.*CSVLogger in out.*cephalo-lightning\[wandb\]'):
        assert cli_loggers.replace_missing_wandb(missing) == ["out"]
    csv, tensorboard = missing.logger
    assert csv == Namespace(class_path=cli_loggers.CSV_LOGGER, init_args=Namespace(save_dir="out", name="p"))
    assert tensorboard == trainer_config().logger[1]
