"""The demo banner: one row across the screen, in the longest wording that fits."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

# Longest first; each says what matters: a demo, tiny, trained on the KJV, not DiffusionGemma's weights.
DEMO_NOTICES = [
    "DEMO MODEL: a tiny model trained on the King James Bible, not DiffusionGemma's weights. "
    "The denoising is the real sampler's.",
    "DEMO MODEL: a tiny model trained on the King James Bible, not DiffusionGemma's weights.",
    "DEMO MODEL: tiny, trained on the KJV Bible; not DiffusionGemma's weights.",
    "DEMO: tiny KJV model, not DiffusionGemma's weights",
]


class DemoBanner(Widget):
    DEFAULT_CSS = "DemoBanner { height: 1; }"

    def render(self) -> Text:
        width = self.content_region.width or 78
        text = next((t for t in DEMO_NOTICES if len(t) <= width), DEMO_NOTICES[-1])
        return Text(text, no_wrap=True, overflow="ellipsis")
