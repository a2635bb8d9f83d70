"""The suite's shared conftest: pytest puts this folder on sys.path, so every test folder can
import the kits kept here (`_cli_kit`: run the CLI in process, check its error contract)."""

import os
import tempfile

# The suite never reads or fills the user's cache of source digests (ernie_ir.artifacts
# .source_digests): each session starts with an empty one of its own. CLI subprocesses inherit it.
os.environ.setdefault("ERNIE_IR_CACHE_DIR", tempfile.mkdtemp(prefix="ernie-ir-test-cache-"))
