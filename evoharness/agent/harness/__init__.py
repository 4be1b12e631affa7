"""The Belief / Progress / Experience harness and its four meta-actions."""

from evoharness.agent.harness.belief import Belief
from evoharness.agent.harness.experience import CATEGORIES, Experience
from evoharness.agent.harness.progress import Progress
from evoharness.agent.harness.workspace import META_VERBS, HarnessConfig, Workspace

__all__ = ["Belief", "CATEGORIES", "Experience", "HarnessConfig", "META_VERBS", "Progress", "Workspace"]
