"""What a shell newcomer reads about the commands: `anima-train --help`, a command's `--help` and the README say the
commands and the adapter methods the code has (cli.COMMANDS, the adapter registry), all of them."""

from __future__ import annotations

import re
from pathlib import Path

from anima_train import adapters, cli
from tests.fixtures_tiny import anima_train_cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_top_help_lists_every_command_and_every_adapter_method(tmp_path):
    out = anima_train_cli("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the description
    for title in (m.title for m in adapters.METHODS.values()):
        assert title in text, f"`anima-train --help` does not name the {title} method"
    listed = re.findall(r"^  (\S+) +(.+)$", out.stdout.split("commands:\n", 1)[1], flags=re.M)
    assert [name for name, _ in listed] == list(cli.COMMANDS)
    assert all(help_text == cli.COMMANDS[name].help for name, help_text in listed)


def test_train_help_names_every_adapter_method(tmp_path):
    out = anima_train_cli("train", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"train a {adapters.table_help()} from a TOML config" in text
    assert all(m.title in text for m in adapters.METHODS.values())


def test_the_readme_lists_every_command():
    # the package list at the top
    summary = re.search(r"the `anima-train` command \(([^)]*)\)", README, flags=re.S)
    assert summary, "README: the `anima-train` command (...) list is gone"
    assert [n.strip() for n in summary.group(1).split("·")] == list(cli.COMMANDS)
    # the Headless CLI block: a line for each command, and no command that does not exist
    block = README.split("## Headless CLI", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    used = set(re.findall(r"anima-train ([a-z][a-z-]*)", block))
    assert used == set(cli.COMMANDS), (f"README's Headless CLI block: missing {sorted(set(cli.COMMANDS) - used)}, "
                                       f"unknown {sorted(used - set(cli.COMMANDS))}")
