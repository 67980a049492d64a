"""``--quant``: every command that takes it lists, in its help, each quantization it accepts
(``config.QUANT_MODES``), and accepts each value its help and its error message name."""
from __future__ import annotations

import argparse

import pytest

from tokenleap.cli.main import build_parser, main
from tokenleap.config import QUANT_MODES


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _quant_help(parser: argparse.ArgumentParser) -> str:
    return next(a.help for a in parser._actions if "--quant" in a.option_strings)


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench", "calibrate", "train-head"])
def test_each_command_s_help_names_every_quantization(command):
    parser = _commands()[command]
    text = _quant_help(parser)
    assert all(mode in text for mode in QUANT_MODES), (command, text)
    rendered = parser.format_help()  # (what --help prints)
    assert "w8a8" in rendered[rendered.index("--quant"):]


def test_calibrate_takes_the_quantizations_its_help_and_its_error_name(capsys):
    code = main(["calibrate", "--model", "smollm2-135m-instruct", "--quant", "int3"])
    err = capsys.readouterr().err
    assert code == 2 and f"choose one of {', '.join(QUANT_MODES)}" in err
    help_text = _quant_help(_commands()["calibrate"])
    for mode in QUANT_MODES:  # each accepted mode is named in the help, and passes the flag check
        assert mode in help_text
        code = main(["calibrate", "--model", "no-such-model", "--quant", mode])
        err = capsys.readouterr().err
        assert code == 2 and "is not a quantization" not in err and "--model 'no-such-model'" in err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_the_draft_s_quantization_help_names_every_mode(command):
    text = next(a.help for a in _commands()[command]._actions if "--draft-quant" in a.option_strings)
    assert all(mode in text for mode in QUANT_MODES), (command, text)
