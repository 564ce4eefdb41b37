"""Checking that a container's command line is a real `tokenmill` command."""

from __future__ import annotations

import click


def resolve(args: list[str]) -> click.Command:
    """The `tokenmill` (sub)command `args` runs; its options and arguments must parse."""
    from tokenmill.cli import main

    command: click.Command = main
    rest = list(args)
    names = ["tokenmill"]
    while isinstance(command, click.Group):
        assert rest, f"`{' '.join(names)}` needs a subcommand"
        name = rest.pop(0)
        sub = command.commands.get(name)
        assert sub is not None, (
            f"`{' '.join(names)}` has no subcommand {name!r} (has {sorted(command.commands)})"
        )
        command, names = sub, [*names, name]
    try:
        command.make_context(" ".join(names), rest)  # parses, never runs
    except click.ClickException as exc:  # a bad option or argument
        raise AssertionError(f"`{' '.join(names)} {' '.join(rest)}`: {exc.format_message()}") from exc
    return command
