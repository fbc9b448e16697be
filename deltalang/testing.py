"""The old path `deltalang.testing`, kept for users' imports: the module `deltalang.models.testing` itself."""

import sys

from deltalang.models import testing as _module

sys.modules[__name__] = _module
