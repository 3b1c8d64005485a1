"""The one error type directives raise: it names the directive, its filter, the reason and a fix."""
from __future__ import annotations

__all__ = ["DirectiveError"]


class DirectiveError(ValueError):
    def __init__(self, directive: str, target: str, reason: str, fix: str = ""):
        self.directive, self.target, self.reason, self.fix = directive, target, reason, fix
        message = f"{directive}({target}): {reason}"
        super().__init__(f"{message}. Fix: {fix}" if fix else message)
