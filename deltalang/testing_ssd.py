"""The old path `deltalang.testing_ssd`, kept for users' imports: the module `deltalang.models.testing_ssd` itself."""

import sys

from deltalang.models import testing_ssd as _module

sys.modules[__name__] = _module
