"""Moved to the package tests/cache/fuzz/ (its __init__ holds the overview this docstring had). This
module only re-exports the package's modules' public names for a benchmark run that started before
the move; delete it once no such run is left."""
from tests.cache.fuzz.check import *  # noqa: F401,F403
from tests.cache.fuzz.edits import *  # noqa: F401,F403
from tests.cache.fuzz.harness import *  # noqa: F401,F403
from tests.cache.fuzz.mutations import *  # noqa: F401,F403
from tests.cache.fuzz.report import *  # noqa: F401,F403
from tests.cache.fuzz.stores import *  # noqa: F401,F403
from tests.cache.fuzz.watch import *  # noqa: F401,F403
