"""`ernie-ir train`'s flags reach the training options through one table
(`ernie_ir.cli.train_opts.TRAIN_OPTION_FLAGS`), not hand-copied code: every TrainOptions field has
a flag in the table or is listed as config-only, so a new field cannot be forgotten; every entry is
a parameter of `train` whose flag is `--` + the field's name (its other names the field's ERNIEKit
aliases); and `flag_options` keeps exactly the flags given."""

from __future__ import annotations

import inspect
import typing

from ernie_ir.cli.run_cmds import train
from ernie_ir.cli.train_opts import CONFIG_ONLY_OPTIONS, TRAIN_OPTION_FLAGS, flag_options
from ernie_ir.training.loop import OPTION_ALIASES, TrainOptions


def _flag_names(param: str) -> list[str]:
    """The names of `train`'s option `param` (typer's param_decls, first the main one)."""
    option = typing.get_type_hints(train, include_extras=True)[param].__metadata__[0]
    # in an Annotated typer.Option the first name sits where the default would (typer reads it so)
    first = [option.default] if isinstance(option.default, str) else []
    return [*first, *option.param_decls]


def test_every_training_option_has_a_flag_in_the_table_or_is_config_only() -> None:
    fields = set(TrainOptions.model_fields)
    flagged = list(TRAIN_OPTION_FLAGS.values())
    assert len(set(flagged)) == len(flagged)  # one flag per field
    assert set(flagged) | CONFIG_ONLY_OPTIONS == fields, "a TrainOptions field without a train flag: add " \
        "it to TRAIN_OPTION_FLAGS (with the flag) or to CONFIG_ONLY_OPTIONS"
    assert not set(flagged) & CONFIG_ONLY_OPTIONS


def test_every_flag_of_the_table_is_a_train_parameter_named_for_its_field() -> None:
    params = inspect.signature(train).parameters
    for param, field in TRAIN_OPTION_FLAGS.items():
        assert param in params and field in TrainOptions.model_fields, (param, field)
        assert params[param].default is None  # not given: the recipe's (or --config's) value stays
        main, *aliases = _flag_names(param)
        assert main == "--" + field.replace("_", "-")
        for alias in aliases:  # --learning-rate: ERNIEKit's learning_rate, an alias of lr
            assert OPTION_ALIASES[alias.removeprefix("--").replace("-", "_")] == field, alias


def test_flag_options_keeps_the_flags_given() -> None:
    params = dict.fromkeys(TRAIN_OPTION_FLAGS)
    assert flag_options(params) == {}
    params.update(lr=0.5, dp=2, sharding="stage1", save_steps=3)
    assert flag_options(params) == {"lr": 0.5, "dp": 2, "sharding": "stage1", "save_steps": 3}
