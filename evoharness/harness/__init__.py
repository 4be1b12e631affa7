"""The Belief / Progress / Experience harness and its four meta-actions."""

from evoharness.harness.belief import Belief
from evoharness.harness.experience import CATEGORIES, Experience
from evoharness.harness.progress import Progress
from evoharness.harness.workspace import META_VERBS, HarnessConfig, Workspace

__all__ = ["Belief", "CATEGORIES", "Experience", "HarnessConfig", "META_VERBS", "Progress", "Workspace"]
