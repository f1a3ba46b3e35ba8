"""Print the README's policy table from the registry (tests/test_registry.py checks the README holds it).

    python scripts/policy_table.py --write   # rewrite the table in README.md in place"""

import re
import sys
from pathlib import Path

from specquant_cli.routing.policies import markdown_table

README = Path(__file__).resolve().parent.parent / "README.md"

if __name__ == "__main__":
    table = markdown_table()
    if "--write" in sys.argv:
        text = README.read_text(encoding="utf-8")
        new = re.sub(r"\| policy \| what runs \| output \|\n(\|.*\|\n)+", table + "\n", text, count=1)
        README.write_text(new, encoding="utf-8")
    else:
        print(table)
