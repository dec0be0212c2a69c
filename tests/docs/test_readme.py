"""The README's commands are the ones CI runs and they point at files that exist."""
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    test_cmd = _bash_blocks(readme.split("Run the tests:", 1)[1])[0].strip()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")]
    assert test_cmd in ci_lines, f"{test_cmd!r} is not a line of .ci/run"
    # Whatever CI runs after installing torch is exactly the README's command: nothing more is installed.
    after_torch = ci_lines[[i for i, ln in enumerate(ci_lines) if "torch==" in ln][0] + 1:]
    assert [ln for ln in after_torch if not ln.startswith(("export ", "set "))] == [test_cmd]


def test_readme_validate_examples_name_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    paths = [shlex.split(ln)[2] for block in _bash_blocks(readme) for ln in block.splitlines()
             if ln.strip().startswith("llmem validate ") and not shlex.split(ln)[2].startswith("--")]
    assert paths, "the README shows no `llmem validate` example"
    for p in paths:
        assert (ROOT / p).is_file(), f"README's validate example names {p}, which does not exist"
