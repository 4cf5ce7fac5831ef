import sys

from .cli import main

code = main()
# CPython quirk (3.11, 3.12): a KeyboardInterrupt raised inside string-exec'd code (dataclasses
# and typing build functions that way while a module imports) flags the interpreter as
# interrupted even though main() caught it, and under `python -m` the process then dies by
# SIGINT instead of exiting with `code` (the console script is not affected). Any string exec
# clears the flag.
exec("")
sys.exit(code)
