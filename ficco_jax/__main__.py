"""`python -m ficco_jax ...`: runs the command line, ficco_jax/tools/cli.py, as the main module."""
import runpy

runpy.run_module("ficco_jax.tools.cli", run_name="__main__", alter_sys=True)
