"""Configuration layering and validation for mpcache's commands.

A command's options are its ``argparse`` definitions and nothing else: every option can be given
as a flag, as an environment variable ``MPCACHE_<DEST>`` (upper case, dashes as underscores) and
as a key of a TOML file named by ``--config FILE`` (the flag's long name, with dashes or
underscores). Precedence: flag > environment > file > built-in default.

Every value is checked when it is read, whatever its source, by the option's ``type`` (the
validators below): a bad value stops the command with one line, ``<prog>: cannot start:
<what> ...``, never a traceback. ``docs/configuration.md`` is generated from the same
definitions (``python -m mpcache.runtime_zmq.config_doc``), and a test keeps the two in sync.

Adding an option: ``config.group(parser, "cache").add_argument("--my-flag", type=config.positive_int,
default=..., help=...)``. Nothing else is needed for its environment variable, file key, effective
config line and documentation.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap
import tomllib
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

ENV_PREFIX = "MPCACHE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@functools.cache
def version() -> str:
    """The installed distribution's version (the source tree's pyproject when not installed).

    Read once per process: the health, stats and metrics answers name it on the server's loop,
    and reading it (a metadata scan or a TOML parse) cost each of them a few hundred µs."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            return dist_version("mpcache")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyproject.toml")
    try:
        with open(here, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


# ---------------------------------------------------------------------------------- validators
# Each takes the raw string (or a TOML scalar) and returns the value, or raises
# argparse.ArgumentTypeError with a message that completes "cannot start: --flag=VALUE: ...".


def _int(text: Any) -> int:
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError("not an integer")
    if isinstance(text, int):
        return text
    try:
        return int(str(text).strip(), 10)
    except ValueError:
        raise argparse.ArgumentTypeError("not an integer") from None


def _float(text: Any) -> float:
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError("not a number")
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError("not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError("not a finite number")
    return value


def port(text: Any) -> int:
    """A TCP port, 0-65535 (0: the system picks a free one)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("a port is 0-65535")
    return value


def positive_int(text: Any) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def non_negative_int(text: Any) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def positive_float(text: Any) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def non_negative_float(text: Any) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def chunk_size(text: Any) -> int:
    """Tokens per chunk: a positive multiple of 16 (vLLM's block sizes are 16, 32, 64, ...)."""
    value = _int(text)
    if value <= 0 or value % 16:
        raise argparse.ArgumentTypeError("must be a positive multiple of 16 (and of vLLM's block size)")
    return value


def log_level(text: Any) -> str:
    value = str(text).strip().upper()
    if value == "WARN":
        value = "WARNING"
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"not a log level; use one of {', '.join(LOG_LEVELS)} (any case)")
    return value


def boolean(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError("not a boolean; use 1/0, true/false, yes/no or on/off")


def one_of(*choices: str) -> Callable[[Any], str]:
    """A case-insensitive choice (the value is returned lower case)."""

    def check(text: Any) -> str:
        value = str(text).strip().lower()
        if value not in choices:
            raise argparse.ArgumentTypeError(f"use one of {', '.join(choices)}")
        return value

    check.__name__ = "one of " + ", ".join(f"`{c}`" for c in choices)
    return check


def host(text: Any) -> str:
    value = str(text).strip()
    if not value or any(c.isspace() for c in value) or "/" in value:
        raise argparse.ArgumentTypeError("not a host name or address")
    return value


# ---------------------------------------------------------------------------------- parser


class CannotStart(Exception):
    """A configuration error: printed as one ``cannot start:`` line."""


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: cannot start: ...`` (exit 2), and
    whose ``--help`` gives each option's default, environment variable and file key from the
    table docs/configuration.md is generated from (``option_table``).

    ``from_environment``: whether ``parse`` reads this parser's options from the environment
    (and a file); False for a subcommand's parser, whose options are flags only."""

    failure = "cannot start"
    from_environment = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", TableHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {self.failure}: {message} (see {self.prog} --help)\n")

    def _get_formatter(self) -> argparse.HelpFormatter:  # argparse has no public hook for this
        formatter = super()._get_formatter()
        if isinstance(formatter, TableHelpFormatter):
            formatter.rows = {id(row.action): row for _, rows in option_table(self) for row in rows}
        return formatter


class TableHelpFormatter(argparse.HelpFormatter):
    """Each option's help line ends ``[default X; env MPCACHE_X; file key x]`` (its row of
    ``option_table``); a paragraph of a description or epilog that is a list (lines starting
    with ``*`` or indented: the L2 URL grammar) is printed as written, the others are filled;
    flags are never broken at their dashes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows: dict[int, OptionRow] = {}

    def _get_help_string(self, action: argparse.Action) -> str | None:
        row = self.rows.get(id(action))
        text = action.help
        if row is None or text is None or text is argparse.SUPPRESS or not row.help_suffix():
            return text
        return f"{text} [{row.help_suffix().replace('%', '%%')}]"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            if any(line.startswith(("*", " ")) for line in para.splitlines()):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent,
                                         break_on_hyphens=False, break_long_words=False))
        return "\n\n".join(out)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def group(parser: argparse.ArgumentParser, title: str, description: str | None = None) -> Any:
    """The parser's argument group called ``title``, created on first use, so that every module
    adding options puts them under one heading."""
    for g in parser._action_groups:  # argparse has no public lookup
        if g.title == title:
            return g
    return parser.add_argument_group(title, description)


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return [a for a in parser._actions if a.option_strings and not isinstance(a, skip) and a.dest != "config"]


def _is_bool(action: argparse.Action) -> bool:
    return isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction, argparse._StoreFalseAction))


def _is_list(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction)


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """The value of ``raw`` (from the environment or a file) for ``action``, validated."""
    try:
        if _is_bool(action):
            value = boolean(raw)
            return (not value) if isinstance(action, argparse._StoreFalseAction) else value
        if _is_list(action):
            split = getattr(action, "env_split", None) or (lambda text: [s for s in text.split(",") if s.strip()])
            items = raw if isinstance(raw, list) else split(str(raw))
            return [_convert_one(action, item) for item in items]
        if isinstance(raw, (list, dict)):
            raise argparse.ArgumentTypeError("expected a single value")
        return _convert_one(action, raw)
    except argparse.ArgumentTypeError as e:
        raise CannotStart(f"{where}={_show(action, raw)}: {e}") from None


def _show(action: argparse.Action, raw: Any) -> str:
    if any(w in action.dest for w in _SECRET_WORDS):
        return "***"
    return str(redact(raw) if isinstance(raw, str) else raw)


def _convert_one(action: argparse.Action, raw: Any) -> Any:
    value = raw
    convert: Any = action.type
    if convert is not None:
        value = convert(raw if isinstance(raw, (int, float)) and convert is not str else str(raw))
    elif not isinstance(raw, str):
        value = str(raw)
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"use one of {', '.join(map(str, action.choices))}")
    return value


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise CannotStart(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CannotStart(f"--config {path}: not valid TOML: {e}") from None


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse ``argv`` over the environment over ``--config FILE`` over the defaults.

    Returns the namespace and, per option dest, where its value came from (``flag``, ``env``,
    ``file``, ``default``). A bad value anywhere exits with one ``cannot start:`` line."""
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _parse(parser, argv, environ)
    except CannotStart as e:
        parser.exit(2, f"{parser.prog}: {getattr(parser, 'failure', 'cannot start')}: {e}\n")


def _parse(
    parser: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str]
) -> tuple[argparse.Namespace, dict[str, str]]:
    actions = _options(parser)
    by_dest = {a.dest: a for a in actions}
    sources = {a.dest: "default" for a in actions}
    overrides: dict[str, Any] = {}
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=environ.get(ENV_PREFIX + "CONFIG"))
    known, _ = pre.parse_known_args(argv)
    if known.config:
        for key, raw in load_toml(known.config).items():
            dest = key.replace("-", "_")
            action = by_dest.get(dest)
            if action is None:
                raise CannotStart(f"--config {known.config}: unknown key {key!r}")
            overrides[dest] = _convert(action, raw, f"{known.config}: {key}")
            sources[dest] = "file"
    for action in actions:
        name = env_name(action)
        if name in environ:
            overrides[action.dest] = _convert(action, environ[name], name)
            sources[action.dest] = "env"
    for action in actions:  # what --help shows: defaults change below, and --help exits in the first parse
        if not hasattr(action, "builtin_default"):
            setattr(action, "builtin_default", action.default)
    for dest, value in overrides.items():
        by_dest[dest].default = value  # not set_defaults: it would survive the suppressed parse
    # which options the command line itself set: parse once more with every default suppressed
    saved = {a.dest: a.default for a in actions}
    for a in actions:
        a.default = argparse.SUPPRESS
    try:
        given = vars(parser.parse_args(argv))
    finally:
        for a in actions:
            a.default = saved[a.dest]
    for dest in given:
        if dest in sources:
            sources[dest] = "flag"
    return parser.parse_args(argv), sources


# ---------------------------------------------------------------------------------- effective config

_SECRET_WORDS = ("password", "secret", "auth_key", "credential")


def redact(value: Any) -> Any:
    """``value`` with the password of any URL in it replaced by ``***``."""
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if not isinstance(value, str) or "@" not in value or "://" not in value:
        return value
    try:
        parts = urllib.parse.urlsplit(value)
    except ValueError:
        return "***"
    if parts.password is None and parts.username is None:
        return value
    user = parts.username or ""
    netloc = f"{user}:***@" if parts.password is not None else f"{user}@"
    netloc += parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def effective(ns: argparse.Namespace, sources: Mapping[str, str]) -> dict[str, Any]:
    """``{dest: value}`` for every option, secrets redacted (for the start log and /status)."""
    out: dict[str, Any] = {}
    for dest in sources:
        value = getattr(ns, dest, None)
        if any(w in dest for w in _SECRET_WORDS) and value:
            value = "***"
        out[dest] = redact(value)
    return out


def effective_line(ns: argparse.Namespace, sources: Mapping[str, str]) -> str:
    """One log line: ``key=value`` for every option, ``(env)``/``(file)``/``(flag)`` after those
    not left at their default."""
    parts = []
    for dest, value in effective(ns, sources).items():
        src = sources[dest]
        parts.append(f"{dest}={value!r}" + ("" if src == "default" else f"({src})"))
    return " ".join(parts)


# ---------------------------------------------------------------------------------- docs


def _flag_text(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0 or _is_bool(action):
        return names
    metavar = action.metavar or action.dest.upper()
    return f"{names} `{metavar}`"


def _type_text(action: argparse.Action) -> str:
    if _is_bool(action):
        return "boolean"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    t = action.type
    if t is None or t is str:
        kind = "string"
    else:
        kind = {
            port: "port 0-65535", positive_int: "integer > 0", non_negative_int: "integer >= 0",
            positive_float: "number > 0", non_negative_float: "number >= 0",
            chunk_size: "multiple of 16, > 0", log_level: "log level (any case)", boolean: "boolean",
            host: "host", int: "integer", float: "number",
        }.get(t, getattr(t, "__name__", "string").replace("_", " "))
    return kind + (" (repeatable)" if _is_list(action) else "")


def builtin_default(action: argparse.Action) -> Any:
    """The default written in the option's definition (``parse`` replaces ``action.default`` by
    a value from the environment or the file before argparse reads the command line)."""
    return getattr(action, "builtin_default", action.default)


def _default_text(action: argparse.Action, defaults: Mapping[str, Any]) -> str:
    value = defaults.get(action.dest)
    if value is None or value == [] or value == () or value is argparse.SUPPRESS:
        return "—"
    return f"`{value}`"


def file_key(action: argparse.Action) -> str:
    """The option's key in a ``--config`` file (``parse`` also takes it with underscores)."""
    return action.dest.replace("_", "-")


def _reads_file(parser: argparse.ArgumentParser) -> bool:
    return any(a.dest == "config" and a.option_strings for a in parser._actions)


class OptionRow:
    """One option's row of the reference: what docs/configuration.md prints and ``--help`` adds
    to the option's line. ``env`` / ``key``: None when the option is a flag only."""

    def __init__(self, action: argparse.Action, default: str, env: str | None, key: str | None) -> None:
        self.action, self.default, self.env, self.key = action, default, env, key
        self.flag, self.type = _flag_text(action), _type_text(action)

    def meaning(self) -> str:
        text = (self.action.help or "").replace("\n", " ")
        return text.replace("%(default)s", self.default.strip("`"))

    def help_suffix(self) -> str:
        default = self.default.strip("`")
        parts = [] if builtin_default(self.action) is argparse.SUPPRESS else [f"default {'none' if default == '—' else default}"]
        if self.env is not None:
            parts.append(f"env {self.env}")
        if self.key is not None:
            parts.append(f"file key {self.key}")
        return "; ".join(parts)


def option_table(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None,
                 env: bool | None = None) -> list[tuple[argparse._ArgumentGroup, list[OptionRow]]]:
    """Every documented option of ``parser`` by argument group: the one table behind
    docs/configuration.md and ``--help``. ``env``: whether the options are read from the
    environment (default: the parser's ``from_environment``); file keys exist where the parser
    has ``--config``."""
    if env is None:
        env = getattr(parser, "from_environment", True)
    defaults = dict(defaults) if defaults is not None else {a.dest: builtin_default(a) for a in parser._actions}
    options = _options(parser)
    key = env and _reads_file(parser)
    table = []
    for g in parser._action_groups:
        rows = [OptionRow(a, _default_text(a, defaults), env_name(a) if env else None, file_key(a) if key else None)
                for a in g._group_actions if a in options and a.help is not argparse.SUPPRESS]
        if rows:
            table.append((g, rows))
    return table


def render_options(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None, env: bool = True) -> str:
    """The options of ``parser`` as markdown tables, one per argument group (``env``: with the
    environment variable column; subcommands' options have none)."""
    out: list[str] = []
    for g, rows in option_table(parser, defaults, env):
        out.append(f"### {g.title}\n")
        if g.description:
            out.append(g.description + "\n")
        out.append("| flag | environment | type | default | meaning |" if env else "| flag | type | default | meaning |")
        out.append("|---|---|---|---|---|" if env else "|---|---|---|---|")
        for r in rows:
            help_text = r.meaning().replace("|", "\\|")
            out.append(f"| {r.flag} |" + (f" `{r.env}` |" if env else "") + f" {r.type} | {r.default} | {help_text} |")
        out.append("")
    return "\n".join(out)


def _iter_lines(text: str | None) -> Iterable[str]:
    for line in (text or "").splitlines():
        yield line[4:] if line.startswith("    ") else line


def l2_grammar() -> list[str]:
    """The L2 URL forms, from runtime_zmq/l2.py's docstring (markdown): docs/configuration.md
    and the epilog of ``mpcache-server --help`` print them."""
    from mpcache.runtime_zmq import l2

    doc = l2.__doc__ or ""
    start = doc.find("Tiers are opened from a URL")
    return list(_iter_lines(doc[start:] if start >= 0 else doc)) + [
        "",
        "`python:MODULE:FACTORY[?ARG]` loads a tier of your own: `FACTORY(ARG)` returns an object",
        "with the L2 tier methods (`read`, `write`, `contains`, `read_many`, `write_many`, `close`, `name`).",
    ]
