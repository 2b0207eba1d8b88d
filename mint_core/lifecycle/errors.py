"""The lifecycle's own error: a step that could not finish."""

from __future__ import annotations

from mint_core.errors import MintError


class LifecycleError(MintError):
    """A lifecycle step could not finish; names the policy and what was found."""
