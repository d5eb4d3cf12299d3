"""The suite refuses to run without the compiled extension (tests/conftest.py), so a broken build
fails CI instead of skipping the extension's tests; FICCO_TESTS_WITHOUT_EXTENSION=1 lets an install
made without it run the rest."""
import os
import pathlib
import subprocess
import sys

import conftest
import pytest

from ficco_jax.runtime import extension

REPO = pathlib.Path(__file__).resolve().parents[1]
# pytest, in a process where `from ficco_jax import _ffi` fails as it does when the build left no module
WITHOUT_FFI = ("import sys; sys.modules['ficco_jax._ffi'] = None; import pytest; "
               "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', 'tests/test_schedule.py']))")


def _pytest_without_ffi(**env):
    environ = {k: v for k, v in os.environ.items() if k != conftest.WITHOUT_EXTENSION}
    return subprocess.run([sys.executable, "-c", WITHOUT_FFI], cwd=REPO, env={**environ, **env}, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(os.environ.get(conftest.WITHOUT_EXTENSION, "") not in ("", "0") and not extension.available(),
                    reason="an install made without the extension (FICCO_TESTS_WITHOUT_EXTENSION)")
def test_this_session_has_the_extension_with_its_cpu_executor():
    assert conftest.extension_problem() is None


def test_a_missing_extension_stops_the_suite_with_the_fix():
    done = _pytest_without_ffi()
    out = done.stdout + done.stderr
    assert done.returncode == 4, out[-3000:]  # pytest's usage error: nothing ran
    assert "the compiled extension ficco_jax._ffi is missing" in out, out[-3000:]
    assert 'pip install -e ".[test]"' in out and "FICCO_TESTS_WITHOUT_EXTENSION=1" in out, out[-3000:]


@pytest.mark.slow
def test_an_install_without_the_extension_can_opt_out():
    done = _pytest_without_ffi(FICCO_TESTS_WITHOUT_EXTENSION="1")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "tests collected" in done.stdout


def test_ci_runs_the_readme_test_command_then_the_rest_of_the_suite():
    readme = (REPO / "README.md").read_text()
    setup = readme[readme.index("## Set up"):readme.index("## Use")]
    commands = [line.split("#")[0].strip() for line in setup.splitlines() if line.startswith("pip install")]
    assert len(commands) == 2 and "pytest" in commands[1], commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci[0] == commands[1], ci
    assert ci[1].startswith("python -m pytest tests -q --tier=rest"), ci
