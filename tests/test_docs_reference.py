"""The generated reference pages (docs/reference/cli.md, config.md) are what the code says, and stay complete.

They are written by ``python -m gossiptrain.cli.reference`` from the argparse parsers and from the comments of
gossiptrain/config.py. A flag, a change of default or a field's comment that is not regenerated fails the first
test with the command that regenerates them; a flag or field without documentation fails the generator itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossiptrain.cli import reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "reference"


def test_the_committed_pages_are_what_the_code_says(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gossiptrain.cli.reference", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    stale = []
    for name in reference.PAGES:
        committed = (PAGES / name).read_text(encoding="utf-8") if (PAGES / name).is_file() else ""
        fresh = (tmp_path / name).read_text(encoding="utf-8")
        if committed != fresh:
            diff = difflib.unified_diff(
                committed.splitlines(), fresh.splitlines(), f"docs/reference/{name}", "from the code", lineterm="", n=1
            )
            stale.append("\n".join(list(diff)[:40]))
    assert not stale, (
        f"docs/reference/ is stale; regenerate it in the repo root with: {reference.REGENERATE}\n\n" + "\n\n".join(stale)
    )


def test_the_pages_show_every_subcommand_flag_and_field() -> None:
    from gossiptrain.cli.main import build_parser
    from gossiptrain.config import RunConfig

    cli = (PAGES / "cli.md").read_text(encoding="utf-8")
    config = (PAGES / "config.md").read_text(encoding="utf-8")

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        assert f"`{path}`" in cli, path
        for action in parser._actions:
            for flag in action.option_strings:
                assert f"`{flag}" in cli, f"{path} {flag}"
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(build_parser(), "gossiptrain")
    for section, values in RunConfig().to_dict().items():
        for name in values:
            assert f"| `{section}.{name}` |" in config, f"{section}.{name}"


def test_a_flag_without_help_text_fails_the_generator_naming_it() -> None:
    parser = argparse.ArgumentParser(prog="gossiptrain")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("peer", help="join a swarm and train")
    p.add_argument("--documented", help="has its text")
    p.add_argument("--undocumented-flag", type=int)
    with pytest.raises(reference.ReferenceError, match=r"`gossiptrain peer` --undocumented-flag has no help text"):
        reference.render_cli(parser)


def test_a_subcommand_without_help_or_description_fails_the_generator_naming_it() -> None:
    parser = argparse.ArgumentParser(prog="gossiptrain")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("mystery")
    with pytest.raises(reference.ReferenceError, match=r"`gossiptrain mystery` has no help text"):
        reference.render_cli(parser)


def test_the_cli_page_shows_defaults_choices_and_required_flags() -> None:
    parser = argparse.ArgumentParser(prog="gossiptrain", description="the command")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("run", help="run something")
    p.add_argument("--mode", choices=("fast", "slow"), default="fast", help="how | fast (%(default)s)")
    p.add_argument("--where", required=True, metavar="HOST:PORT", help="the target, <host>:port")
    p.add_argument("--flag", action="store_true", help="a switch")
    page = reference.render_cli(parser)
    assert "| `--mode {fast,slow}` | `fast` | how \\| fast (fast) Choices: `fast`, `slow`. |" in page
    assert "| `--where HOST:PORT` | — | the target, &lt;host&gt;:port **Required.** |" in page
    assert "| `--flag` | off | a switch |" in page


def _section(source: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<config>", "exec"), namespace)  # noqa: S102  (a dataclass made up by this test)
    return namespace


SECTION = '''
from dataclasses import dataclass

@dataclass(frozen=True)
class Section:
    """A section.

    Its longer text.
    """

    plain: int = 1  # on its line
    # above it, on two lines,
    # which belong to the field below
    above: float = 2.0
    both: str = "x"  # type: ignore[assignment]  # after a pragma
    nothing: int = 1 << 4
'''


def test_a_field_without_a_meaning_fails_the_generator_naming_it() -> None:
    classes = {"sect": _section(SECTION)["Section"]}
    with pytest.raises(reference.ReferenceError, match=r"without a meaning: sect\.nothing\. Write one"):
        reference.config_fields(SECTION, classes)


def test_a_field_means_the_comments_above_it_and_on_its_line() -> None:
    source = SECTION.replace("    nothing: int = 1 << 4\n", "    nothing: int = 1 << 4  # sixteen\n")
    classes = {"sect": _section(source)["Section"]}
    [(section, doc, fields)] = reference.config_fields(source, classes)
    assert (section, doc) == ("sect", "A section.\n\nIts longer text.")
    meanings = {f.key: f.meaning for f in fields}
    assert meanings == {
        "sect.plain": "on its line",
        "sect.above": "above it, on two lines, which belong to the field below",
        "sect.both": "after a pragma",
        "sect.nothing": "sixteen",
    }
    by_key = {f.key: f for f in fields}
    assert (by_key["sect.nothing"].default, by_key["sect.nothing"].expression) == ("16", "1 << 4")
    assert (by_key["sect.both"].default, by_key["sect.both"].type) == ('"x"', "str")


def test_every_run_configuration_field_has_a_meaning() -> None:
    from gossiptrain.config import RunConfig

    sections = reference.config_fields()
    assert [s for s, _, _ in sections] == [f.name for f in dataclasses.fields(RunConfig)]
    assert all(f.meaning for _, _, fields in sections for f in fields)


def test_the_generator_needs_no_torch() -> None:
    code = (
        "import sys; from gossiptrain.cli import reference; reference.render_cli(); reference.render_config(); "
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
