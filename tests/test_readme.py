"""The README is executable and its pointers hold: every ```python block runs as a script (as a
reader would paste it into a file), the README stays within 8,000 characters, and every file,
link and test the README and docs/ name exists."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_python_blocks_and_fits_in_8000_characters():
    assert BLOCKS, "README.md has no ```python block"
    assert len(README.read_text()) <= 8000, f"README.md is {len(README.read_text())} characters; move detail to docs/"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README python block {index} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_files_and_tests_named_exist(page):
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(f"link {target}")
    for path in re.findall(r"\b((?:tests|benchmarks|piper_plugin|recipes|adapters)/[\w/.-]+\.(?:py|md))", text):
        if not (ROOT / path).exists():
            missing.append(f"file {path}")
    for path in re.findall(r"(?<![\w/])((?:api|ir|passes|scheduler|runtime|autograd)/[\w/.-]+\.py)", text):
        if not (ROOT / "piper_plugin" / path).exists():
            missing.append(f"file piper_plugin/{path}")
    for path, test in re.findall(r"\b([\w/]*test_\w+\.py)::(\w+)", text):
        source = ROOT / (path if "/" in path else f"tests/{path}")
        if not source.exists() or not re.search(rf"^\s*def {test}\(", source.read_text(), re.M):
            missing.append(f"test {path}::{test}")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"
