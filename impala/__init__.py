"""IMPALA / V-trace actor-critic trainer."""

import os
import sys
import types

# Checked here, before any module of the package is read: they use what Python 3.11 added (datetime.UTC, ...), and
# without this an older Python fails at an import with a traceback.
if sys.version_info < (3, 11):  # noqa: UP036 - the check is for the Pythons ruff is told are not used
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "impala"
    version = ".".join(str(part) for part in sys.version_info[:3])
    sys.stderr.write(f"{program}: error: impala needs Python 3.11 or later; this is Python {version}\n")
    raise SystemExit(2)

# TensorBoard's event writer (torch's SummaryWriter) takes TensorFlow's file API wherever TensorFlow is installed,
# which imports all of it: seconds at start, its log lines, and its own import errors where that install is broken.
# The trainer writes local files only, so it always takes TensorBoard's own, as it does where TensorFlow is absent.
# The module below is TensorBoard's switch for that (tensorboard/compat/__init__.py).
sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
