"""A stage module that calls sys.exit() as it imports: validating a pipeline naming it used
to end the command with that exit code and no word."""

import sys

sys.exit(5)
