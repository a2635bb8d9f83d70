"""An interrupt (SIGTERM is raised as one) that lands just as the weight writer's sha256 thread
starts must not leave the process waiting at exit. A ThreadPoolExecutor's worker is registered for
the exit wake-up a step after it starts: a killed compile hung there, idle, in CI."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CODE = textwrap.dedent('''
    import threading
    from ernie_ir.ir import weights

    start = threading.Thread.start

    def interrupted_start(self):
        start(self)
        if self.name.startswith("ernie-ir-sha256"):
            raise KeyboardInterrupt  # where SIGTERM can land: the thread runs, nothing else is done

    threading.Thread.start = interrupted_start
    try:
        weights._HASHER.submit(len, b"x")
    except KeyboardInterrupt:
        print("interrupted")
''')


def test_the_process_exits_after_an_interrupt_at_the_hashers_start():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done.stderr
