"""The suite's shared conftest: pytest puts this folder on sys.path, so every test folder can
import the kits kept here (`_cli_kit`: run the CLI in process, check its error contract)."""

import atexit
import os
import shutil
import tempfile

# The suite never reads or fills the user's cache of source digests (ernie_ir.artifacts
# .source_digests): each session starts with an empty one of its own, removed at exit. CLI
# subprocesses inherit it.
if "ERNIE_IR_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="ernie-ir-test-cache-")
    os.environ["ERNIE_IR_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
