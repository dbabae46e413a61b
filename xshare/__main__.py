"""``python -m xshare ...``: the same command as the ``xshare`` console script."""

import sys


def _exit(code: int) -> None:
    if code == 130:
        # CPython (3.8 to 3.12 at least): a KeyboardInterrupt that ends a *string* exec (dataclasses
        # and namedtuple build their methods that way, so any import can be inside one) sets the
        # interpreter's "unhandled KeyboardInterrupt" flag even though we caught it, and under
        # ``python -m`` the interpreter then kills itself with SIGINT at exit (status -2, not our
        # 130). Every string exec clears the flag when it starts; an empty one does nothing else.
        exec("")
    sys.exit(code)


if __name__ == "__main__":
    try:
        from xshare.cli.main import main
    except KeyboardInterrupt:  # Ctrl-C while Python imports the command line itself
        print("xshare: interrupted", file=sys.stderr)
        _exit(130)
    _exit(main())
