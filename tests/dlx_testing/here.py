"""`dlx` run in the test's own process: Click's runner on the real `dlx` command tree
(workers.cli.command), so the same code parses the arguments, prints the output and picks
the exit code, without a fresh interpreter importing torch and web3 (seconds of CPU a call).

For the tests that are about what a command finds out (a verification's report, a
collection's files), not about the process a shell starts: those that check what a shell
sees, or change what the process is (another kernel set, patched code), run the installed
binary."""

from __future__ import annotations

import subprocess
from typing import Any

from click.testing import CliRunner


def dlx_here(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`dlx ARGS` in this process, with `env` added to the environment for the call: a
    CompletedProcess like `subprocess.run(..., capture_output=True, text=True)` gives.
    An exception the command did not turn into an exit code is raised as it came."""
    from workers.cli import command

    argv = [str(a) for a in args]
    result = CliRunner().invoke(command(), argv, env=env, prog_name="dlx")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["dlx", *argv], result.exit_code, result.stdout, result.stderr)
