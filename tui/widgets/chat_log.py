"""The conversation: user turns, answers as Markdown, the thought channel collapsed."""

from __future__ import annotations

from functools import partial

from textual.containers import Vertical, VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

from mlx_dgemma.text import printable


class Answer(Vertical):
    def __init__(self, answer_id: int, **kw):
        super().__init__(classes="answer", **kw)
        self.answer_id = answer_id
        self._thought = Static("", classes="thought-text")
        self._collapsible = Collapsible(self._thought, title="thought", collapsed=True)
        self._collapsible.display = False
        self._md = Markdown("…")
        self.target = "…"  # the text the answer should show
        self.rendered = "…"  # the text the Markdown widget has finished rendering

    def compose(self):
        yield self._collapsible
        yield self._md

    def set_text(self, answer: str, thinking: str = "", note: str = "") -> None:
        if thinking:
            self._collapsible.display = True
            self._thought.update(printable(thinking))
        self.target = printable(answer or "…") + (f"\n\n*{note}*" if note else "")
        # Markdown renders asynchronously: an exclusive worker cancels a stale render, so a
        # late update of an earlier block can never overwrite the final answer.
        self.run_worker(partial(self._render_markdown, self.target), exclusive=True, group="markdown")

    async def _render_markdown(self, text: str) -> None:
        await self._md.update(text)
        self.rendered = text


class ChatLog(VerticalScroll):
    def on_mount(self) -> None:
        # Anchored: the log follows the answer as it grows (resizes included) until the user
        # scrolls up, and follows again once they scroll back to the end.
        self.anchor()

    def add_user(self, text: str) -> None:
        self.mount(Static(text, classes="user"))
        self.scroll_end(animate=False)

    def add_answer(self, answer_id: int) -> Answer:
        a = Answer(answer_id)
        self.mount(a)
        self.scroll_end(animate=False)
        return a

    def add_notice(self, text: str, error: bool = False) -> None:
        self.mount(Static(text, classes="error" if error else "notice"))
        self.scroll_end(animate=False)
