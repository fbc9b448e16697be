"""transformers as quiet as the command line: `quiet_transformers()`, the one helper the CLI and `load_model` use.

Contract: no weight-loading progress bars and no kernel "falling back to its reference PyTorch
implementation" notices, only transformers' errors. Said through the environment (which
transformers reads when it is first imported), so a command that never needs transformers never
imports it; once transformers is imported, its logging is set directly. FutureWarnings are
ignored. `load_model(verbose=True)` skips it, leaving transformers as it was.
"""

from __future__ import annotations

import os
import sys
import warnings


def quiet_transformers() -> None:
    """Errors only from transformers, no progress bars, no FutureWarnings (see the module doc)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
