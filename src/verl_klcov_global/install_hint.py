"""How to install the plugin: the one sentence every error message and doc uses (no imports, no side effects)."""

#: The package is not published on any index; this says so and gives the routes that work.
INSTALL_HINT = (
    "verl-klcov-global is not on any package index: install it from its source into the Python "
    "environment verl runs in (the Ray workers' too): `pip install /path/to/verl-klcov-global` (a clone), "
    "`pip install verl_klcov_global-<version>-py3-none-any.whl` (a wheel built from one with "
    "`pip wheel --no-deps -w dist /path/to/verl-klcov-global`) or `pip install \"git+<repository URL>\"`; "
    "README.md, \"Install\""
)
