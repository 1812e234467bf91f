"""`jaxserve serve --help=...` as vLLM has it: `listgroup` (the argument groups), a group's name
(`ModelConfig`), a flag's name (`max-num-seqs`), `page` (everything, through a pager) or a keyword
searched for in flag names, help texts and group titles (`--help=max`)."""

from __future__ import annotations

import argparse
import pydoc


def _groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    return [g for g in parser._action_groups if g._group_actions]


def _format(parser: argparse.ArgumentParser, sections: list[tuple[str | None, list[argparse.Action]]]) -> str:
    formatter = parser._get_formatter()
    for title, actions in sections:
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
    return formatter.format_help()


def help_text(parser: argparse.ArgumentParser, query: str) -> str:
    """The text `--help=query` prints for the (sub)command `parser`; a ValueError naming the query when
    nothing matches."""
    q = query.strip()
    groups = _groups(parser)
    if q == "listgroup":
        return "Argument groups (show one with --help=GROUP):\n" + "".join(
            f"  {g.title}\n" for g in groups)
    if q == "page":
        return parser.format_help()
    for g in groups:
        if g.title and g.title.lower() == q.lower():
            return _format(parser, [(g.title, g._group_actions)])
    flag = "--" + q.lstrip("-")
    for g in groups:
        exact = [a for a in g._group_actions if flag in a.option_strings or q in a.option_strings]
        if exact:
            return _format(parser, [(g.title, exact)])
    needle = q.lower().lstrip("-")
    found = [(g.title, hits) for g in groups
             if (hits := [a for a in g._group_actions
                          if needle in (g.title or "").lower() or needle in (a.help or "").lower()
                          or any(needle in o.lower() for o in a.option_strings)])]
    if not found:
        raise ValueError(f"--help={query}: no argument group, flag or help text matches {query!r}; "
                         "--help=listgroup lists the groups")
    return _format(parser, found)


def print_help(parser: argparse.ArgumentParser, query: str) -> int:
    """Print `--help=query` (through a pager for `page`); the exit code."""
    try:
        text = help_text(parser, query)
    except ValueError as e:
        parser.error(str(e))
        return 2
    if query == "page":
        pydoc.pager(text)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
