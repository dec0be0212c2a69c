"""Run the CLI in-process and capture what it prints."""

from llmem_plugin.cli.app import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``llmem ARGV...`` through the entry function: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
