"""The reference pages generated from the code, so that they cannot drift from it: the commands table, every
command's --help, the settings, the policies, the server's metrics and the draft recipes.

A generated block in a markdown page sits between two markers that name it:

    <!-- BEGIN GENERATED: settings (python -m specquant_cli.reference) -->
    ...
    <!-- END GENERATED: settings -->

`python -m specquant_cli.reference` rewrites every block of README.md and docs/*.md from the code; `--check`
changes nothing and exits 1 naming the pages that differ (tests/test_reference.py runs it, as simonw/llm's CI runs
`cog --check`). GENERATORS says which pages hold each block: a block or a page missing from its place (a marker
misspelled or removed, a page deleted) is a difference too, named by page and block, and so is a block on a page the
table does not name. `--root DIR` reads the pages of another checkout. The help is rendered at COLUMNS=100, the width
the help is written to fit."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from specquant_cli.errors import InputError
from specquant_cli.inputs import decode_input

HELP_COLUMNS = 100
ROOT = Path(__file__).resolve().parent.parent  # the checkout the pages live in
PAGES = ("README.md", "docs/*.md")
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[a-z-]+)(?![a-z-])[^>]*-->\n)(?P<body>.*?)"
                    r"(<!-- END GENERATED: (?P=name) -->)", re.DOTALL)


def _app():
    from specquant_cli.cli import app

    return app


def _walk(command, path: list[str]):
    """Every visible command below `command` (a click group), with its path of names, in help order."""
    yield path, command
    for name in getattr(command, "list_commands", lambda ctx: [])(None):
        sub = command.commands[name]
        if not sub.hidden:
            yield from _walk(sub, [*path, name])


def _click_root():
    import typer

    return typer.main.get_command(_app())


def help_text(path: list[str]) -> str:
    """`specquant PATH --help` as a terminal of HELP_COLUMNS columns shows it, without colour."""
    from typer.testing import CliRunner

    env = {"COLUMNS": str(HELP_COLUMNS), "NO_COLOR": "1", "TERM": "dumb"}  # set for the call by the runner
    result = CliRunner().invoke(_app(), [*path, "--help"], prog_name="specquant", env=env,
                                terminal_width=HELP_COLUMNS)
    if result.exit_code != 0:
        raise RuntimeError(f"specquant {' '.join(path)} --help exited {result.exit_code}: {result.output}")
    return "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())


def commands() -> str:
    """The table of commands: each one's panel, name and one-line help."""
    from specquant_cli.cli import PANELS

    order = [name for names in PANELS.values() for name in names]
    found = sorted(((p, c) for p, c in _walk(_click_root(), []) if p),
                   key=lambda pc: (order.index(pc[0][0]) if pc[0][0] in order else len(order), len(pc[0]) > 1))
    rows = ["| | command | what it does |", "|---|---|---|"]
    for path, cmd in found:
        panel = getattr(cmd, "rich_help_panel", None) or ""
        panel = f"{path[0]}: {panel.lower()}" if len(path) > 1 else panel
        rows.append(f"| {panel} | `specquant {' '.join(path)}` | {cmd.get_short_help_str(limit=200)} |")
    return "\n".join(rows)


def cli() -> str:
    """Every command's --help, each under its own heading."""
    out = []
    for path, _ in _walk(_click_root(), []):
        name = " ".join(["specquant", *path])
        out += [f"### `{name}`", "", "```", help_text(path), "```", ""]
    return "\n".join(out).rstrip("\n")


def settings() -> str:
    """Every setting: its specquant.toml key, option, variable, default and what it does."""
    from specquant_cli.commands import options  # noqa: F401  (the policy table registers its names first)
    from specquant_cli.settings import settings_table

    rows = ["| `[table]` key | option | variable | default | what it does |", "|---|---|---|---|---|"]
    for s in settings_table().values():
        default = s.shown if s.shown is not None else ("on" if s.default else "off") if s.kind is bool \
            else "none" if s.default is None else s.default
        flag = (f"`{s.flag}` / `--no-{s.flag[2:]}`" if s.kind is bool else f"`{s.flag}`") if s.flag else "—"
        text = s.description.replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `[{s.branch}]` `{s.name}` | {flag} | `{s.env}` | {default} | {text} |")
    return "\n".join(rows)


def policies() -> str:
    from specquant_cli.routing.policies import markdown_table

    return markdown_table()


def metrics() -> str:
    """The metrics of GET /metrics, read from a Metrics of a server with a prompt cache."""
    from prometheus_client.parser import text_string_to_metric_families

    from specquant_cli.serving.metrics import CACHE_COUNTERS, CACHE_GAUGES, Metrics

    class _Svc:  # what the scrape reads of a running service, at zero
        class worker:  # noqa: N801
            @staticmethod
            def status() -> dict:
                return {"running": 0, "queued": 0}

        @staticmethod
        def prompt_cache_status() -> dict:
            return dict.fromkeys([*CACHE_COUNTERS, *CACHE_GAUGES], 0)

    rows = ["| metric | type | what it counts |", "|---|---|---|"]
    for fam in text_string_to_metric_families(Metrics(_Svc(), ["parent"]).render().decode()):
        if fam.name.endswith("_created"):  # prometheus_client's creation times, beside each counter
            continue
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
        shown = name + (f"{{{','.join(labels)}}}" if labels else "")
        rows.append(f"| `{shown}` | {fam.type} | {fam.documentation} |")
    return "\n".join(rows)


def recipes() -> str:
    from specquant_cli.family.variants import RECIPES

    rows = ["| recipe (role) | base type | importance matrix | graded to | what it is |", "|---|---|---|---|---|"]
    for r in RECIPES.values():
        rows.append(f"| `{r.role}` | {r.base} | {'yes' if r.imatrix else 'no'} | "
                    f"{f'{r.grade:g} bpw' if r.grade is not None else '—'} | {r.help} |")
    return "\n".join(rows)


# What the reference generates: each block's name, the function that writes it and the pages (under the root) that
# hold it. The check holds the pages to it both ways: a listed block missing from its page, or a block on a page
# not listed for it, is a difference.
GENERATORS: dict[str, tuple[Callable[[], str], tuple[str, ...]]] = {
    "commands": (commands, ("README.md", "docs/cli.md")), "cli": (cli, ("docs/cli.md",)),
    "settings": (settings, ("docs/configuration.md",)), "policies": (policies, ("docs/policies.md",)),
    "metrics": (metrics, ("docs/serve.md",)), "recipes": (recipes, ("docs/models.md",))}


def render(text: str, made: dict[str, str] | None = None, page: str = "a page") -> str:
    """`text` with every generated block written anew (`made` caches each block's text across pages); an unknown
    block is an InputError naming `page` and the block."""
    made = {} if made is None else made

    def block(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise InputError(f"{page}: unknown generated block {name!r} (known: {', '.join(GENERATORS)})")
        if name not in made:
            made[name] = GENERATORS[name][0]()
        return f"{m.group(1)}{made[name]}\n{m.group(4)}"

    return _BLOCK.sub(block, text)


def pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def _name(p: Path, root: Path) -> str:
    return p.relative_to(root).as_posix()


def _read(p: Path, root: Path) -> str:
    """A page's text; one that cannot be read, or is not UTF-8, is an InputError naming it."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"{_name(p, root)}: cannot read the page ({e.strerror or e})") from None
    return decode_input(data, _name(p, root))


def misplaced(root: Path = ROOT) -> list[str]:
    """Where the pages under `root` and GENERATORS disagree, one line per page and block: a block missing from a
    page the table names (its markers misspelled or removed, or the page gone), or on a page it does not name."""
    found = {_name(p, root): {m.group("name") for m in _BLOCK.finditer(_read(p, root))} for p in pages(root)}
    out = []
    for name, (_, places) in GENERATORS.items():
        for page in places:
            if page not in found:
                out.append(f"{page}: generated block {name!r} is missing: the page is gone")
            elif name not in found[page]:
                out.append(f"{page}: generated block {name!r} is missing (no '<!-- BEGIN GENERATED: {name}' ... "
                           f"'<!-- END GENERATED: {name} -->' pair: a marker misspelled or removed)")
    for page, names in found.items():
        for name in sorted(n for n in names if n in GENERATORS and page not in GENERATORS[n][1]):
            out.append(f"{page}: generated block {name!r} is not placed on this page (reference.GENERATORS puts it "
                       f"on {', '.join(GENERATORS[name][1])})")
    return out


def stale(root: Path = ROOT) -> list[Path]:
    """The pages under `root` whose generated blocks differ from what the code makes now."""
    made: dict[str, str] = {}
    return [p for p in pages(root) if (t := _read(p, root)) != render(t, made, _name(p, root))]


def write(root: Path = ROOT) -> list[Path]:
    """Rewrite every stale page; the pages written."""
    made: dict[str, str] = {}
    written = []
    for p in pages(root):
        text = _read(p, root)
        new = render(text, made, _name(p, root))
        if new != text:
            p.write_text(new, encoding="utf-8")
            written.append(p)
    return written


USAGE = "usage: python -m specquant_cli.reference [--check] [--root DIR]"


def main(argv: list[str], root: Path = ROOT) -> int:
    args = list(argv)
    if "--root" in args:
        i = args.index("--root")
        if i + 1 >= len(args):
            print(f"error: --root needs a folder ({USAGE})", file=sys.stderr)
            return 2
        root = Path(args.pop(i + 1))
        args.pop(i)
    if args not in ([], ["--check"]):
        print(USAGE, file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"error: --root {root}: not a folder", file=sys.stderr)
        return 2
    try:
        if args == ["--check"]:
            differ = [f"{_name(p, root)}: generated reference differs from the code; run python -m "
                      "specquant_cli.reference" for p in stale(root)] + misplaced(root)
        else:
            for p in write(root):
                print(f"wrote {_name(p, root)}", file=sys.stderr)
            differ = misplaced(root)  # nothing writing can mend: a marker or a page to put back
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in differ:
        print(line, file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
