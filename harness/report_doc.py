"""Former home of the ``rrh check`` document; it is now the package :mod:`harness.report`.

Kept so that code written against the old path keeps importing (every name of
``harness.report.__all__``); new code imports :mod:`harness.report`. The hand-written JSON-Schema
validator that lived here is gone: the tests validate the document with ``jsonschema`` (the ``dev``
extra).
"""

from harness.report import *  # noqa: F403  (the re-export is this module's only job)
from harness.report import __all__ as __all__
