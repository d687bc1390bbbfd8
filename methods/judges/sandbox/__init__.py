"""The code judge's two sandboxed programs, run by path inside their sandboxes
(``python -I <this folder>/candidate.py <fds>``; bubblewrap binds this folder read-only at its own
path), and the codec both use to pass values between them:

- :mod:`.candidate`: runs the answer's program, then answers calls from the tester;
- :mod:`.tester`: runs the task's tests with the program's names bound to proxies of those calls;
- :mod:`.codec`: plain data by value, anything else as a handle only its owner can resolve.

They use the standard library only (the sandboxes' interpreter is the system's, without the
project's packages) and are linted and imported by the tests like any module.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
"""What the sandboxes bind read-only and run from."""
CANDIDATE = FOLDER / "candidate.py"
TESTER = FOLDER / "tester.py"
