"""``python -m parity``: the same as the ``parity`` console script.

``python -m`` puts the current directory first on ``sys.path``; the console script does not. So
that both find the same modules (and a module lying in the current directory, a bundle's
``payload.py`` say, is never imported by accident), that entry is taken off here. The commands
put the current directory back only for a subject spec the user named themselves.
"""
import os
import sys

if sys.path and not getattr(sys.flags, "safe_path", False):
    try:
        if os.path.realpath(sys.path[0] or os.curdir) == os.path.realpath(os.getcwd()):
            del sys.path[0]
    except OSError:  # the current directory was removed: nothing to match
        pass

from parity.cli.main import entry  # noqa: E402  (after the sys.path fix, on purpose)

entry()
