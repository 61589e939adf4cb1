"""Helpers shared by the integration tests: the README's commands, read from the README itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_command(heading: str, starts_with: str) -> str:
    """The command in the README's section `heading` whose first line starts with `starts_with`,
    its continuation lines joined, exactly as a user pastes it into bash."""
    text = README.read_text()
    marker = f"\n## {heading}\n"
    if marker not in text:
        raise LookupError(f"README.md has no section '## {heading}'")
    section = text.split(marker, 1)[1].split("\n## ", 1)[0]
    for block in section.split("```bash\n")[1:]:
        lines = block.split("```", 1)[0].splitlines()
        for i, line in enumerate(lines):
            if line.startswith(starts_with):
                parts = []
                for cont in lines[i:]:
                    parts.append(cont.strip().removesuffix("\\").strip())
                    if not cont.rstrip().endswith("\\"):
                        return " ".join(parts)
    raise LookupError(f"README.md section '## {heading}' has no command starting with {starts_with!r}")


@pytest.fixture(scope="session")
def readme() -> Callable[[str, str], str]:
    return readme_command
