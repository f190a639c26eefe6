"""``gpufleet simulate`` runs on a lean app (one command): it must be the whole app's command."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from gpufleet.cli._app import app
from gpufleet.cli._lean import lean_app


def test_the_lean_simulate_answers_as_the_whole_app() -> None:
    lean = lean_app(["simulate"])
    assert lean is not None
    runner = CliRunner()
    for args in (["simulate", "--help"], ["simulate", "--bogus"], ["simulate"]):
        whole, alone = runner.invoke(app, args), runner.invoke(lean, args)
        assert (alone.exit_code, alone.output) == (whole.exit_code, whole.output), args


def test_other_commands_take_the_whole_app() -> None:
    assert lean_app([]) is None
    assert lean_app(["plan"]) is None
    assert lean_app(["--help"]) is None


def test_simulate_imports_no_gateway_store_or_kubernetes() -> None:
    code = (
        "import sys; sys.argv = ['gpufleet', 'simulate', '--help']\n"
        "from gpufleet.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in sys.modules if m.startswith(('gpufleet.gateway', 'gpufleet.store',"
        " 'kubernetes', 'sqlalchemy'))]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
