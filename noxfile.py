"""The test matrix: both ends of the supported range (docs/index.md, "Supported versions").

    nox                 # both sessions
    nox -s oldest       # Python 3.11 + jax 0.10.x, the full suite
    nox -s newest       # Python 3.12 + the newest jax, the fast subset, DeprecationWarning = error
    nox -s newest -- tests/ffi -x     # arguments after -- go to pytest (replacing the defaults)
    nox -s lint         # the checks of .ci/run: layer contract, ruff, mypy (pyproject.toml)

Each session makes its own venv under .nox/ and installs the checkout editable with the test
extra, as a newcomer would. The interpreters must be on PATH as python3.11 / python3.12 (with
pyenv: PYENV_VERSION=3.11.7:3.12.1, as .ci/run sets). Editable installs compile the FFI fences
into xshare/ffi/ for the session's jaxlib; an environment with another jaxlib then rebuilds its
own copy once into ~/.cache/xshare/ffi-<hash>-jaxlib<version>/ (xshare/ffi/_loader.py).
"""

from __future__ import annotations

import nox

nox.options.sessions = ["oldest", "newest"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True  # a missing end is a failure, not a skip

VERSIONS = ("import sys, jax, jaxlib, flax, optax, numpy; "
            "print('python', sys.version.split()[0], '| jax', jax.__version__, '| jaxlib', "
            "jaxlib.__version__, '| flax', flax.__version__, '| optax', optax.__version__, "
            "'| numpy', numpy.__version__)")


# What the newest end runs (see ``newest``); ``nox -s newest -- tests`` runs everything there.
# (tests/ffi but the canary's, whose children go through the fences tests/ffi/test_fences.py runs)
NEWEST = ["tests/runtime", "tests/nnx", "tests/users", "tests/tune", "tests/serving", "tests/ffi",
          "--ignore=tests/ffi/test_canary.py", "tests/test_jax_compat.py", "tests/test_api.py",
          "tests/test_imports.py"]


@nox.session(python="3.11")
def oldest(session: nox.Session) -> None:
    """The oldest supported pair: Python 3.11 and jax/jaxlib 0.10.x; the whole suite."""
    session.install("-e", ".[test]", "jax==0.10.*", "jaxlib==0.10.*")
    session.run("python", "-c", VERSIONS)
    # (every test: the default run leaves the slow ones out, pyproject.toml addopts)
    session.run("python", "-m", "pytest", "-q", *(session.posargs or ["-m", "slow or not slow"]))


@nox.session(python="3.12")
def newest(session: nox.Session) -> None:
    """The newest pair: Python 3.12 and the newest jax/jaxlib pip resolves (no pins).

    The tests whose outcome depends on those versions (``NEWEST``: equivalence with jax.jit,
    the FFI against the newest jaxlib, Flax/optax/Equinox/Optuna/tritonclient as their users
    write them), fast subset (``-m "not slow"``), with DeprecationWarnings as errors. The rest
    (the CLI's processes and signals, the docs, pure scheduling and memory logic, the status
    server) does not change with jax's version and runs at the oldest end, which keeps .ci/run
    under twenty minutes.
    """
    session.install("--upgrade", "--upgrade-strategy", "eager", "-e", ".[test]")
    session.run("python", "-c", VERSIONS)
    args = session.posargs or ["-m", "not slow", *NEWEST]
    session.run("python", "-W", "error::DeprecationWarning", "-m", "pytest", "-q", *args)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """The checks .ci/run makes after the tests, each configured in pyproject.toml: the layer
    contract (import-linter's ``lint-imports``), ruff, and mypy on xshare/. The test extra
    (which includes the lint extra) so that mypy sees every optional library's types."""
    session.install("-e", ".[test]")
    session.run("lint-imports")
    session.run("ruff", "check", "xshare", "models", "benchmarks", "tests")
    session.run("mypy")
