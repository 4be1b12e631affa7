"""Progress: the episode's checklist of committed subgoals, driven by ``commit``."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_OPEN = 8


@dataclass
class Progress:
    """``commit X`` marks every open subgoal done and opens X (the agent moved on to X).

    Committing the text of an open subgoal closes just that one; ``commit done`` closes all.
    At most ``MAX_OPEN`` subgoals are open: the oldest open one is closed to make room.
    """

    items: list[tuple[str, bool]] = field(default_factory=list)  # (subgoal, done)

    def commit(self, subgoal: str) -> str:
        s = " ".join(subgoal.strip().lower().split())
        if not s:
            return "commit needs a subgoal"
        if s in ("done", "all done", "finished"):
            self.items = [(g, True) for g, _ in self.items]
            return "all subgoals done"
        if (s, False) in self.items:
            self.items = [(g, d or g == s) for g, d in self.items]
            return f"done: {s}"
        closed = [g for g, d in self.items if not d]
        self.items = [(g, True) for g, _ in self.items] + [(s, False)]
        while sum(not d for _, d in self.items) > MAX_OPEN:
            i = next(i for i, (_, d) in enumerate(self.items) if not d)
            self.items[i] = (self.items[i][0], True)
        return f"now: {s}" + (f" (done: {', '.join(closed)})" if closed else "")

    @property
    def open(self) -> list[str]:
        return [g for g, d in self.items if not d]

    def checklist(self) -> str:
        if not self.items:
            return "(empty)"
        return " ".join(f"[{'x' if d else ' '}] {g};" for g, d in self.items[-6:]).rstrip(";")
